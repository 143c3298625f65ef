"""The video job store (``serve/video_store.py``, ``video_disk.py``,
``video_jobs.py``): OpenAI's job objects through a job's life, the bounds
(bytes and TTL; full: refused with an honest Retry-After, an unfetched
video never evicted), atomic files in a folder of the server's own, one
owner's jobs hidden from another, cursor pages, and a restart that lists
finished videos again and fails unfinished ones by name. No server, a fake
clock, tmp_path."""

from __future__ import annotations

import os
import re
import stat
import threading

import pytest
from openai.types import Video
from video_decode import decode_mp4, smooth_noise

from diffrt.engine.video_files import clip_files
from diffrt.serve.images import StoreFull
from diffrt.serve.video_disk import DirInUse, VideoDir, default_video_dir
from diffrt.serve.video_jobs import decode_job, owner_of
from diffrt.serve.video_store import RECORD_BYTES, VideoStore

KB = 1024


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def open_store(path, clock: Clock, *, max_bytes: int = 1 << 20, ttl_s: float = 100.0):
    return VideoStore(path, max_bytes=max_bytes, ttl_s=ttl_s, clock=clock)


@pytest.fixture
def store(tmp_path, clock):
    s = open_store(tmp_path / "videos", clock)
    yield s
    s.close()


def make(store: VideoStore, *, owner: str | None = None, reserve: int = 10 * KB,
         prompt: str = "a fox") -> str:
    return store.create(model="tiny-wan", seconds="1", size="64x64", prompt=prompt,
                        owner=owner, reserve_bytes=reserve,
                        settings={"prompt": prompt, "seed": 1}).id


def finish(store: VideoStore, job_id: str, video: bytes = b"v" * 2000, **more: bytes) -> None:
    store.start(job_id)
    assert store.complete(job_id, {"video": video, **more}) is not None


def openai_video(job) -> Video:
    """``job``'s public object read as the ``openai`` client's ``Video``: every
    field it has and no other (its ``size`` type lists Sora's sizes only; the
    client itself builds a response without checking them)."""
    public = job.public()
    assert set(public) == set(Video.model_fields)
    return Video.model_validate({**public, "size": "1280x720"})


def read(store: VideoStore, job_id: str, variant: str = "video", owner: str | None = None):
    opened = store.open_file(job_id, owner, variant)
    if opened is None:
        return None
    handle, size, media_type = opened
    with handle:
        data = handle.read()
    assert len(data) == size
    return data, media_type


def test_a_job_is_openais_video_object_through_its_life(store, clock) -> None:
    job_id = make(store)
    assert re.fullmatch(r"video_[0-9a-f]{32}", job_id)
    assert make(store) != job_id
    queued = openai_video(store.get(job_id, None))
    assert (queued.object, queued.status, queued.progress) == ("video", "queued", 0)
    assert (queued.created_at, queued.completed_at, queued.expires_at) == (int(clock.now),
                                                                           None, None)
    assert (queued.model, queued.seconds, queued.prompt) == ("tiny-wan", "1", "a fox")
    assert store.get(job_id, None).public()["size"] == "64x64"
    assert store.start(job_id).status == "in_progress"
    store.set_progress(job_id, 40.7)
    assert store.get(job_id, None).progress == 40
    store.set_progress(job_id, 10)  # progress never goes back
    assert store.get(job_id, None).progress == 40
    clock.now += 5
    store.complete(job_id, {"video": b"mp4 bytes", "thumbnail": b"png bytes"})
    done = openai_video(store.get(job_id, None))
    assert (done.status, done.progress, done.error) == ("completed", 100, None)
    assert done.completed_at == int(clock.now) and done.expires_at == int(clock.now + 100)
    assert read(store, job_id) == (b"mp4 bytes", "video/mp4")
    assert read(store, job_id, "thumbnail") == (b"png bytes", "image/png")
    assert read(store, job_id, "spritesheet") is None  # not made


def test_a_failed_job_says_why(store, clock) -> None:
    job_id = make(store)
    store.start(job_id)
    store.fail(job_id, "generation_failed", "the engine failed: boom")
    failed = openai_video(store.get(job_id, None))
    assert failed.status == "failed"
    assert (failed.error.code, failed.error.message) == ("generation_failed",
                                                         "the engine failed: boom")
    assert failed.expires_at == int(clock.now + 100)
    assert read(store, job_id) is None
    assert store.complete(job_id, {"video": b"late"}) is None  # a finished job stays so
    assert not (store._dir.file_path(job_id, "video")).exists()


def test_files_are_written_whole_in_a_folder_of_the_servers_own(tmp_path, store,
                                                                monkeypatch) -> None:
    folder = tmp_path / "videos"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    job_id = make(store)
    finish(store, job_id, b"first")
    video = folder / f"{job_id}.video.mp4"
    assert stat.S_IMODE(video.stat().st_mode) == 0o600
    assert decode_job((folder / f"{job_id}.json").read_bytes()).status == "completed"
    assert not [p for p in os.listdir(folder) if ".tmp-" in p]

    def crash(fd: int) -> None:
        raise OSError("disk gone")
    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        store._dir.write_atomic(video, b"second")
    assert video.read_bytes() == b"first"  # the old file whole, no temporary left
    assert not [p for p in os.listdir(folder) if ".tmp-" in p]


def test_a_job_that_does_not_fit_is_refused_with_the_time_room_frees(tmp_path, clock) -> None:
    store = open_store(tmp_path / "v", clock, max_bytes=3 * RECORD_BYTES + 30 * KB)
    first = make(store, reserve=10 * KB)
    finish(store, first, b"x" * 10 * KB)            # expires at +100
    clock.now += 30
    second = make(store, reserve=10 * KB)
    finish(store, second, b"y" * 10 * KB)           # expires at +130
    running = make(store, reserve=10 * KB)
    with pytest.raises(StoreFull) as full:
        make(store, reserve=10 * KB)
    assert full.value.retry_after_s == 70            # the first video's expiry frees enough
    assert "as finished videos expire" in str(full.value)
    with pytest.raises(StoreFull) as full:
        make(store, reserve=20 * KB)                 # needs both finished videos gone
    assert full.value.retry_after_s == 100
    # neither unfetched video was evicted to try
    assert read(store, first) is not None and read(store, second) is not None
    with pytest.raises(ValueError, match="does not fit in the video store"):
        make(store, reserve=40 * KB)                 # not even in an empty store
    with pytest.raises(ValueError, match="reserve_bytes must be >= 0"):
        make(store, reserve=-RECORD_BYTES)
    assert store.get(running, None).status == "queued"
    store.close()


def test_room_held_by_running_jobs_is_retried_after_the_ttl(tmp_path, clock) -> None:
    store = open_store(tmp_path / "v", clock, max_bytes=2 * RECORD_BYTES + 20 * KB, ttl_s=250)
    make(store, reserve=10 * KB)
    make(store, reserve=10 * KB)
    with pytest.raises(StoreFull) as full:
        make(store, reserve=10 * KB)
    assert full.value.retry_after_s == 250
    assert "2 unfinished jobs' videos are fetched or expire" in str(full.value)
    store.close()


def test_a_fetched_video_makes_room_an_unfetched_one_never(tmp_path, clock) -> None:
    store = open_store(tmp_path / "v", clock, max_bytes=2 * RECORD_BYTES + 20 * KB)
    kept, fetched = make(store), make(store)
    finish(store, kept, b"k" * 10 * KB)
    finish(store, fetched, b"f" * 10 * KB)
    read(store, kept, "thumbnail")                   # a thumbnail is not the video
    with pytest.raises(StoreFull):
        make(store)
    read(store, fetched)
    new = make(store)                                # the fetched video went to make room
    assert store.get(fetched, None) is None
    assert not (tmp_path / "v" / f"{fetched}.video.mp4").exists()
    assert read(store, kept)[0] == b"k" * 10 * KB
    assert store.get(new, None).status == "queued"
    store.close()


def test_finished_jobs_expire_after_the_ttl(store, clock, tmp_path) -> None:
    done, failed, running = make(store), make(store), make(store)
    finish(store, done)
    store.fail(failed, "generation_failed", "x")
    held = store.usage()["bytes"]
    assert held == 3 * RECORD_BYTES + 2000 + 10 * KB
    clock.now += 99.5
    assert store.get(done, None) is not None
    clock.now += 1
    assert store.get(done, None) is None and store.get(failed, None) is None
    assert store.get(running, None).status == "queued"   # unfinished: no TTL yet
    assert store.usage()["bytes"] == RECORD_BYTES + 10 * KB
    assert sorted(os.listdir(tmp_path / "videos")) == [".lock", f"{running}.json"]


def test_jobs_are_seen_only_with_the_key_that_made_them(store) -> None:
    alice, bob = owner_of("key-a"), owner_of("key-b")
    assert alice != bob and "key-a" not in alice
    job_id = make(store, owner=alice)
    finish(store, job_id)
    assert store.get(job_id, bob) is None and store.get(job_id, None) is None
    assert read(store, job_id, owner=bob) is None
    assert store.list(bob).jobs == [] and store.list(None).jobs == []
    assert store.delete(job_id, bob) is None
    assert [j.id for j in store.list(alice).jobs] == [job_id]
    assert read(store, job_id, owner=alice) is not None
    record = (store._dir.record_path(job_id)).read_text()
    assert "key-a" not in record and alice in record


def test_ids_that_are_not_ours_touch_nothing(store, tmp_path) -> None:
    (tmp_path / "secret.json").write_text("{}")
    for bad in ("../secret", "video_../../secret", "video_" + "0" * 31, "VIDEO_" + "0" * 32):
        assert store.get(bad, None) is None
        assert store.open_file(bad, None, "video") is None
        assert store.delete(bad, None) is None
    assert (tmp_path / "secret.json").exists()


def test_list_pages_by_cursor_in_openais_shape(store, clock) -> None:
    ids = []
    for n in range(5):
        ids.append(make(store, prompt=f"p{n}"))
        clock.now += 1
    page = store.list(None, limit=2)
    shape = page.public()
    assert shape["object"] == "list" and shape["has_more"] is True
    assert [v["id"] for v in shape["data"]] == ids[:-3:-1]          # newest first
    assert (shape["first_id"], shape["last_id"]) == (ids[4], ids[3])
    seen = [j.id for j in page.jobs]
    while page.has_more:
        page = store.list(None, after=page.jobs[-1].id, limit=2)
        seen += [j.id for j in page.jobs]
    assert seen == ids[::-1]
    ascending = store.list(None, order="asc", limit=100)
    assert [j.id for j in ascending.jobs] == ids and not ascending.has_more
    assert [j.id for j in store.list(None, order="asc", after=ids[1], limit=2).jobs] == ids[2:4]
    assert store.list(None, after=ids[0]).public() == {
        "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    with pytest.raises(KeyError):
        store.list(None, after="video_" + "f" * 32)
    with pytest.raises(ValueError, match="limit: must be 1-100"):
        store.list(None, limit=0)


def test_delete_removes_the_job_and_its_files(store, tmp_path) -> None:
    job_id = make(store)
    finish(store, job_id)
    removed = store.delete(job_id, None)
    assert removed.status == "completed"
    assert store.get(job_id, None) is None
    assert sorted(os.listdir(tmp_path / "videos")) == [".lock"]
    assert store.usage()["bytes"] == 0


def test_a_job_deleted_while_its_files_are_written_leaves_none(store, tmp_path,
                                                               monkeypatch) -> None:
    job_id = make(store)
    store.start(job_id)
    write = store._dir.write_atomic

    def write_then_delete(target, data):
        write(target, data)
        store.delete(job_id, None)                   # a DELETE arriving mid-encode
    monkeypatch.setattr(store._dir, "write_atomic", write_then_delete)
    assert store.complete(job_id, {"video": b"late"}) is None
    assert sorted(os.listdir(tmp_path / "videos")) == [".lock"]
    assert store.usage()["bytes"] == 0


def test_a_restart_lists_finished_videos_and_fails_unfinished_ones(tmp_path, clock) -> None:
    folder = tmp_path / "videos"
    before = open_store(folder, clock)
    done, old, missing, queued, running, failed = (make(before) for _ in range(6))
    finish(before, old, b"old")
    clock.now += 50
    finish(before, done, b"done", thumbnail=b"png")
    finish(before, missing, b"gone")
    before.start(running)
    before.set_progress(running, 50)
    before.fail(failed, "generation_failed", "boom")
    before.close()                                   # as a crash leaves the folder
    (folder / f"{missing}.video.mp4").unlink()
    (folder / f".{done}.video.mp4.tmp-0a1b2c3d").write_bytes(b"half")  # a cut-short write
    (folder / ("video_" + "e" * 32 + ".video.mp4")).write_bytes(b"orphan")
    (folder / "notes.txt").write_text("not ours")

    clock.now += 60                                  # `old` expired while the server was down
    after = open_store(folder, clock)
    listed = {job.id: job for job in after.list(None, limit=100).jobs}
    assert set(listed) == {done, missing, queued, running, failed}
    assert read(after, done) == (b"done", "video/mp4")
    for job_id in (queued, running):
        job = openai_video(listed[job_id])
        assert job.status == "failed" and job.error.code == "server_restarted"
        assert job.expires_at == int(clock.now + 100)
    assert listed[missing].error.code == "video_file_missing"
    assert listed[failed].error.code == "generation_failed"
    assert decode_job((folder / f"{queued}.json").read_bytes()).status == "failed"  # saved
    assert sorted(p for p in os.listdir(folder) if not p.endswith(".json")) == [
        ".lock", "notes.txt", f"{done}.thumbnail.png", f"{done}.video.mp4"]
    new = make(after)                                # later ids still list after older ones
    assert after.list(None, limit=1).jobs[0].id == new
    after.close()


def test_an_unreadable_record_is_removed_saying_so(tmp_path, clock, caplog) -> None:
    folder = tmp_path / "videos"
    store = open_store(folder, clock)
    job_id = make(store)
    store.close()
    (folder / f"{job_id}.json").write_text("{not json")
    with caplog.at_level("WARNING"):
        reopened = open_store(folder, clock)
    assert reopened.list(None).jobs == []
    assert "unreadable job record" in caplog.text and job_id in caplog.text
    reopened.close()


def test_one_server_at_a_time_in_a_folder_it_owns(tmp_path, clock, monkeypatch) -> None:
    store = open_store(tmp_path / "videos", clock)
    with pytest.raises(DirInUse, match="in use by another diffrt server"):
        open_store(tmp_path / "videos", clock)
    store.close()
    open_store(tmp_path / "videos", clock).close()   # free once closed
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(PermissionError, match="not this server's"):
        VideoDir(tmp_path / "videos")


def test_the_default_folder_is_in_diffrts_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DIFFRT_CACHE_DIR", str(tmp_path / "cache"))
    assert default_video_dir() == str(tmp_path / "cache" / "videos")


def test_the_bounds_are_serve_flags() -> None:
    from diffrt.cli import build_parser
    from diffrt.cli.serve_opts import build_serve_settings

    settings = build_serve_settings(build_parser().parse_args([
        "serve", "--video-ttl-s", "60", "--video-store-bytes", "1GiB", "--video-dir", "/x"]))
    assert (settings.video_ttl_s, settings.video_store_bytes, settings.video_dir) == (
        60.0, 1 << 30, "/x")
    defaults = build_serve_settings(build_parser().parse_args(["serve"]))
    assert (defaults.video_ttl_s, defaults.video_store_bytes, defaults.video_dir) == (
        3600.0, 4 << 30, None)


def test_fetched_videos_stay_when_evicting_them_would_not_make_room(tmp_path, clock) -> None:
    store = open_store(tmp_path / "v", clock, max_bytes=3 * RECORD_BYTES + 30 * KB)
    fetched, running = make(store), make(store, reserve=20 * KB)
    finish(store, fetched, b"f" * 10 * KB)
    read(store, fetched)
    with pytest.raises(StoreFull):
        make(store, reserve=25 * KB)                 # 10 KB freed would not be enough
    assert read(store, fetched) is not None          # so it was not evicted for nothing
    assert store.get(running, None) is not None
    store.close()


def test_concurrent_creations_never_pass_the_bound(tmp_path, clock) -> None:
    store = open_store(tmp_path / "v", clock, max_bytes=10 * (RECORD_BYTES + 10 * KB))
    made, refused = [], []

    def worker() -> None:
        for _ in range(5):
            try:
                made.append(make(store))
            except StoreFull:
                refused.append(1)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (len(made), len(refused)) == (10, 10)
    assert store.usage()["bytes"] == store.max_bytes
    store.close()


def test_the_encoders_files_are_kept_and_served_back_whole(store) -> None:
    frames = smooth_noise(1, frames=5)
    job_id = make(store, reserve=frames.nbytes)
    store.start(job_id)
    store.complete(job_id, clip_files(frames, 8, lossless=True))
    data, media_type = read(store, job_id)
    assert media_type == "video/mp4"
    assert (decode_mp4(data).frames == frames).all()
    assert read(store, job_id, "spritesheet")[1] == "image/jpeg"
    assert store.get(job_id, None).files["video"] == len(data)
    store._dir.file_path(job_id, "video").unlink()     # removed behind the server's back
    assert read(store, job_id) is None
