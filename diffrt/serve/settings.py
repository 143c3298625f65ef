"""What a server needs besides the engine's own configuration, declared once.

As the engine's settings (``engine/settings.py``), each field declares its
type, default, limits and help in ``msgspec.Meta``: ``diffrt serve``'s flags
and their help (``cli/serve_opts.py``) and the table of flags in
docs/serving.md (``scripts/settings_docs.py``) are built from these, so a
new server option is one declaration here plus the code that uses it. A flag
is the field's name with dashes (``max_pending`` -> ``--max-pending``;
seconds end in ``_s``) unless ``extra`` names another (``flag``); ``extra``
also says which group of the help it sits in (``group``: "edge" for the
bounds of the HTTP edge, "ray" for the replicas) and its metavar.

Three declarations, each read by its own room: ``ServeSettings`` by the app
(routes, middleware, guards, the URL store, the video store), ``HttpLimits`` by uvicorn's
configuration (``server.py``), ``ReplicaOptions`` by the Ray Serve
application (``ray_app.ReplicaSettings`` adds its behaviour). Building one in
Python checks nothing (as before); the command line checks the values it
was given against the declarations (``runtime.types.convert_declared``:
one line naming the field).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from diffrt.engine.sampling import MAX_PRIORITY, MIN_PRIORITY

#: the environment variable ``diffrt serve`` (and ``bench --base-url``) read the API key from
API_KEY_ENV = "DIFFRT_API_KEY"
_Bytes = Annotated[int, Meta(ge=1)]
_Seconds = Annotated[float, Meta(gt=0)]


class ServeSettings(msgspec.Struct, kw_only=True, frozen=True):
    """Server options (``diffrt serve`` flags); the engine's are an EngineConfig.

    The bounds of the connection itself (header size and time, idle time, the
    count of connections) are uvicorn's: ``HttpLimits``.
    """

    model_name: Annotated[str | None, Meta(extra={"flag": "--served-model-name"}, description=(
        "the model id clients send as model and /v1/models lists; None: the engine's "
        "model (--model)"))] = None
    api_key: Annotated[tuple[str, ...] | str | None, Meta(
        extra={"env": API_KEY_ENV, "metavar": "KEY[,KEY...]"}, description=(
            "require 'Authorization: Bearer KEY' on /v1 (/health, /ready and /metrics stay "
            "open); several keys (the flag repeated, or a comma list): any of them is "
            "accepted, and a video job is seen only with the key that created it; "
            f"diffrt serve's default: ${API_KEY_ENV} (a comma list too); None: no "
            "key"))] = None
    max_pending: Annotated[int, Meta(ge=1, description=(
        "requests that may wait to be admitted (accepted, not yet running); past it a new "
        "one gets 429 with Retry-After"))] = 64
    retry_after_s: Annotated[int, Meta(ge=1, description=(
        "the least Retry-After, in seconds, that a 429 for a full server suggests (it "
        "suggests the engine's predicted time to its next admission when longer; this "
        "before the step-cost model's first fit)"))] = 1
    sleep_requests: Annotated[Literal["wait", "refuse"], Meta(description=(
        "requests that arrive while the engine sleeps (POST /sleep): wait for POST /wake_up, "
        "or are refused with 503 and Retry-After: sleep_retry_after_s"))] = "wait"
    sleep_retry_after_s: Annotated[int, Meta(ge=1, description=(
        "the Retry-After, in seconds, of a 503 for a sleeping engine (sleep_requests "
        "refuse)"))] = 5
    shutdown_timeout_s: Annotated[float, Meta(ge=0, description=(
        "seconds requests in flight may take to finish after SIGTERM/SIGINT before they "
        "are aborted"))] = 30.0
    max_body_bytes: Annotated[_Bytes, Meta(extra={"unit": "bytes"}, description=(
        "the largest request body; larger: 413"))] = 1 << 20
    max_edit_body_bytes: Annotated[_Bytes, Meta(extra={"unit": "bytes"}, description=(
        "the largest body of POST /v1/images/edits, its images and mask together; "
        "larger: 413"))] = 32 << 20
    max_video_body_bytes: Annotated[_Bytes, Meta(extra={"unit": "bytes"}, description=(
        "the largest body of POST /v1/videos (its first frame, input_reference); larger: "
        "413"))] = 32 << 20
    max_edit_bytes_in_flight: Annotated[_Bytes, Meta(extra={"unit": "bytes"}, description=(
        "the bytes of edit bodies held at once (being received, or read into the engine's "
        "arrays); an edit whose body finds no room: 429 with Retry-After"))] = 256 << 20
    url_ttl_s: Annotated[float, Meta(ge=0, description=(
        "seconds a response_format=\"url\" image is kept; an unexpired image is never "
        "evicted: a url request that does not fit is refused (429)"))] = 600.0
    url_max_images: Annotated[int, Meta(ge=1, description=(
        "the most response_format=\"url\" images kept at once"))] = 256
    url_max_bytes: Annotated[_Bytes, Meta(extra={"unit": "bytes"}, description=(
        "the most bytes of response_format=\"url\" images kept at once"))] = 256 << 20
    rollout_ttl_s: Annotated[_Seconds, Meta(description=(
        "seconds a request's rollout download (return_log_probs, return_trajectory: GET "
        "/v1/rollouts/{id}) is kept; an unexpired one is never evicted: a rollout request "
        "that does not fit is refused (429)"))] = 600.0
    rollout_max_bytes: Annotated[_Bytes, Meta(extra={"unit": "bytes"}, description=(
        "the most bytes of rollout downloads kept at once (a request's room is taken at "
        "submission, at its file's largest size: a trajectory at the output arena's bytes a "
        "pixel until the server has measured one)"))] = 1 << 30
    weights_dir: Annotated[str | None, Meta(extra={"metavar": "DIR"}, description=(
        "the folder POST /v1/weights may read transformer weights from (a path is accepted "
        "when its real path, symlinks resolved, lies inside it, as --lora-dir); None: "
        "POST /v1/weights takes uploaded files only"))] = None
    max_upload_body_bytes: Annotated[_Bytes, Meta(extra={"unit": "bytes"}, description=(
        "the largest body of POST /v1/weights and PUT /v1/loras/{name} (an uploaded "
        "safetensors file, held in memory while it is read); larger: 413"))] = 256 << 20
    default_video: Annotated[bool, Meta(description=(
        "on a server of the default model (diffrt-shapes, an image model), also serve "
        "/v1/videos with the default video model (diffrt-motion) on an engine of its own, "
        "started and drained with the first (its own worker process); "
        "--no-default-video: images only. Another --model serves what it makes; Ray Serve's "
        "replicas serve the one model given"))] = True
    video_dir: Annotated[str | None, Meta(extra={"metavar": "DIR"}, description=(
        "the folder the video jobs and their files are kept in (made with mode 0700; one "
        "server at a time: it is locked while open); a restart lists its finished videos "
        "again; None: videos in diffrt's cache folder ($DIFFRT_CACHE_DIR, else "
        "~/.cache/diffrt)"))] = None
    video_store_bytes: Annotated[_Bytes, Meta(extra={"unit": "bytes"}, description=(
        "the most bytes the video jobs hold at once (finished videos, and the room running "
        "jobs reserve for theirs); a job that does not fit is refused (429 with "
        "Retry-After): an unfetched finished video is never evicted before it "
        "expires"))] = 4 << 30
    video_ttl_s: Annotated[_Seconds, Meta(description=(
        "seconds a finished video (or a failed job's record) is kept"))] = 3600.0
    lora_dir: Annotated[str | None, Meta(extra={"metavar": "DIR"}, description=(
        "the folder POST /v1/loras may register LoRA adapters from (a path is accepted "
        "when its real path, symlinks resolved, lies inside it; diffrt serve: an existing "
        "folder, one engine); None: run-time registration is refused (403), so no client "
        "can make the server read a file of its choosing (adapters given at start, "
        "lora_modules, need none)"))] = None
    client_priority_floor: Annotated[
        Annotated[int, Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)] | None, Meta(description=(
            "an HTTP request whose priority is below this is refused (400), so clients "
            "cannot claim the classes the operator keeps for others; a request naming none "
            "gets max(0, floor); None: any priority the engine takes"))] = None
    allowed_hosts: Annotated[tuple[Annotated[str, Meta(min_length=1)], ...] | None, Meta(
        extra={"group": "edge", "metavar": "H[,H...]"}, description=(
            "the Host header names answered ('*.example.com' patterns allowed, '*' any); "
            "others get 400. None: any host (the app alone); diffrt serve's default: the "
            "bound address, plus localhost when it is a loopback address, any host when "
            "bound to 0.0.0.0 or ::"))] = None
    public_url: Annotated[str | None, Meta(extra={"group": "edge", "metavar": "URL"},
                                           description=(
        "the base of response_format=\"url\" image URLs, e.g. https://images.example.com; "
        "never built from the request's Host; None: relative URLs"))] = None
    max_request_line_bytes: Annotated[_Bytes, Meta(extra={"group": "edge", "unit": "bytes"},
                                                   description=(
        "the longest request target (path and query); longer: 414"))] = 8 << 10
    body_timeout_s: Annotated[_Seconds, Meta(extra={"group": "edge"}, description=(
        "seconds to receive a whole request body; then 408"))] = 30.0

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys accepted (``api_key``: one key, or several; empty: none needed)."""
        key = self.api_key
        if not key:
            return ()
        return (key,) if isinstance(key, str) else tuple(k for k in key if k)


class HttpLimits(msgspec.Struct, kw_only=True, frozen=True):
    """What one connection may hold (``diffrt serve`` flags; uvicorn's settings)."""

    max_header_bytes: Annotated[_Bytes, Meta(extra={"unit": "bytes"}, description=(
        "the request line and headers together; larger: 400 (h11's "
        "max_incomplete_event_size, and the parsed head)"))] = 16 << 10
    header_timeout_s: Annotated[_Seconds, Meta(description=(
        "seconds from a connection's opening (or its next request's first byte) to the "
        "end of the request's headers; then the connection is closed"))] = 10.0
    keep_alive_timeout_s: Annotated[_Seconds, Meta(description=(
        "seconds an idle kept-alive connection stays open"))] = 5.0
    limit_concurrency: Annotated[int, Meta(ge=1, description=(
        "connections (and requests in progress) beyond this are answered 503 at "
        "once"))] = 512


class ReplicaOptions(msgspec.Struct, kw_only=True, frozen=True):
    """How many model replicas serve on Ray Serve, and what each asks of Ray
    (``ray_app.ReplicaSettings`` adds the deployment options made from them).
    Any of these given on the command line serves on Ray (docs/scale-out.md)."""

    replicas: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(extra={"metavar": "N"},
                                                                description=(
        "model replicas, each owning one engine on its own device(s) (with autoscaling: "
        "the initial count); None with autoscaling: min_replicas"))] = 1
    min_replicas: Annotated[int, Meta(ge=1, description=(
        "autoscaling: the fewest replicas"))] = 1
    max_replicas: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(extra={"metavar": "N"},
                                                                    description=(
        "autoscaling (Ray Serve's autoscaling_config) between min_replicas and this; "
        "None: a fixed count"))] = None
    target_ongoing_requests: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(
        extra={"metavar": "R"}, description=(
            "autoscaling: requests per replica to aim for; None: max_num_seqs"))] = None
    upscale_delay_s: Annotated[float, Meta(ge=0, description=(
        "autoscaling: seconds the load must stay above target before a replica is "
        "added"))] = 30.0
    downscale_delay_s: Annotated[float, Meta(ge=0, description=(
        "autoscaling: seconds the load must stay below target before one is "
        "removed"))] = 600.0
    look_back_s: Annotated[_Seconds, Meta(description=(
        "autoscaling: the window, in seconds, over which the load is averaged (as Ray's "
        "own)"))] = 30.0
    replica_cpus: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(
        extra={"metavar": "C"}, description=(
            "CPUs each replica reserves in Ray (fractions allowed; the engine's worker "
            "processes are its own, outside Ray's count); None: on CPU an equal share of "
            "the node's CPUs less the ingress's, elsewhere 1"))] = None


#: the fields of ReplicaOptions that only autoscaling reads
AUTOSCALING_FIELDS = ("min_replicas", "target_ongoing_requests", "upscale_delay_s",
                      "downscale_delay_s", "look_back_s")


__all__ = ["API_KEY_ENV", "AUTOSCALING_FIELDS", "HttpLimits", "ReplicaOptions", "ServeSettings"]
