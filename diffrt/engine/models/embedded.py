"""The embedded models (`tiny-flux`, `tiny-sd3`): complete tiny diffusers
folders written on first use into the diffrt cache, then loaded exactly as a
user's checkpoint is (model_index.json, the folder's own text encoders and
tokenizers, the family's diffusers pipeline).

A folder is built from fixed seeds by its family's builder (a
"module:function" path, e.g. ``tiny/flux.py``'s
``build_tiny_flux_folder``) out of the shared pieces of ``tiny/shared.py``, so
the same library versions give the same files on every machine. Its name
carries a key of the source of the builder's module, of the diffrt modules it
imports and of ``tiny/shared.py``, the builder's arguments and the versions of
the libraries that wrote it, so an upgrade or an edit of any of those modules
writes a fresh folder instead of reading one written by other initialisation
code.

Several processes may ask for the same folder at once (workers starting
together, two servers on one host): each builds into its own temporary folder
next to the final one and renames it into place; the first rename wins and the
others discard theirs, so a reader never sees a half-written folder.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from diffrt.engine.models.folder_check import JsonObject, ModelLoadError, cache_dir

logger = logging.getLogger(__name__)

#: The shared builder pieces: their source is part of every folder's key, next
#: to the source of the builder's own module (and the modules it imports), so
#: editing any of them builds anew.
SHARED_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny", "shared.py")
#: A temporary build folder older than this was left by a killed process.
STALE_BUILD_S = 3600.0


@dataclass(frozen=True)
class EmbeddedModel:
    """A tiny folder: which builder writes it, with which arguments."""

    builder: str  # "module:function", called as builder(folder, **kwargs)
    kwargs: JsonObject = field(default_factory=dict)
    #: sampling defaults on top of the family's (a quick image, not 1024 px in 28 steps).
    sampling_defaults: JsonObject = field(default_factory=dict)
    #: spec fields on top of the family's description (a tiny editing model
    #: keeps its input's size instead of the 1 Mpx its family was trained at)
    spec_overrides: JsonObject = field(default_factory=dict)
    #: the step caches' calibration of this checkpoint, ``CacheSupport`` fields
    #: (``thresholds``, ``teacache_rescale``) on top of the family's; the
    #: values are what ``benchmarks/bench_cache.py`` fitted and chose for it
    cache: JsonObject = field(default_factory=dict)


#: TeaCache's rescaling of the tiny models, fitted by ``benchmarks/bench_cache.py``
#: (section 2, 2026-12-02: a line over 432 steps of 16 uncached 28-step
#: requests each, R^2 0.24 and 0.37; docs/caching.md). Their first-block
#: threshold: tiny-flux the policy's 0.1 (0.55x transformer time at 52 dB);
#: tiny-sd3 0.2 (0.1 reuses nothing there, 0.3 falls below 30 dB)
TINY_FLUX_TEACACHE = (1.55095281e+00, -1.36186726e-02)
TINY_SD3_TEACACHE = (2.18057681e+00, 4.73439378e-02)
#: tiny-wan's (no published polynomial for Wan 2.2's experts), by the same
#: routine on Wan's signal, the time embedding (``bench_cache.py --fit-only
#: tiny-wan``, 2026-12-06: a line over 432 steps of 16 uncached 28-step clips
#: across both experts, x 0.31..1.47, R^2 0.51)
TINY_WAN_TEACACHE = (6.57629848e-01, -1.98888603e-01)

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    # FLUX.1-dev-style: guidance-distilled, so guidance_scale is an input.
    "tiny-flux": EmbeddedModel("diffrt.engine.models.tiny.flux:build_tiny_flux_folder",
                               {"seed": 20261129, "guidance_embeds": True},
                               {"height": 128, "width": 128, "num_inference_steps": 4},
                               cache={"teacache_rescale": TINY_FLUX_TEACACHE}),
    # SD3 Medium-style: two CLIPs + T5, CFG with an (empty) negative prompt;
    # its transformer's sample_size makes the default 128 px.
    "tiny-sd3": EmbeddedModel("diffrt.engine.models.tiny.sd3:build_tiny_sd3_folder",
                              {"seed": 20261130},
                              {"num_inference_steps": 4},
                              cache={"thresholds": {"first-block": 0.2},
                                     "teacache_rescale": TINY_SD3_TEACACHE}),
    # FLUX.1 Kontext [dev]-style: edits an input image it sees as extra tokens;
    # the input keeps its size (FluxKontextPipeline's ``_auto_resize=False``)
    "tiny-flux-kontext": EmbeddedModel(
        "diffrt.engine.models.tiny.flux:build_tiny_flux_kontext_folder",
        {"seed": 20261201}, {"height": 128, "width": 128, "num_inference_steps": 4},
        {"edit_resize": "keep"}),
    # Qwen-Image-Edit-style: Qwen2.5-VL reads the input image with the prompt;
    # its input area is 64 x 64 px, not the 1 Mpx of the released model
    "tiny-qwen-image-edit": EmbeddedModel(
        "diffrt.engine.models.tiny.qwen_image_edit:build_tiny_qwen_image_edit_folder",
        {"seed": 20261202}, {"num_inference_steps": 4}, {"edit_area": 64 * 64}),
    # its Plus layout (several input images), the same components: the VAE's
    # input area 64 x 64 px, Qwen2.5-VL's smaller (40 x 40), as the released
    # model's 384^2 is smaller than its 1 Mpx, so the two copies differ
    "tiny-qwen-image-edit-plus": EmbeddedModel(
        "diffrt.engine.models.tiny.qwen_image_edit:build_tiny_qwen_image_edit_folder",
        {"seed": 20261202, "plus": True}, {"num_inference_steps": 4},
        {"edit_area": 64 * 64, "edit_prompt_area": 40 * 40}),
    # Wan 2.2 A14B-style text-to-video: two experts switched at the folder's
    # boundary ratio; 9 frames of 64 x 64 px, not 81 of 480 x 832
    "tiny-wan": EmbeddedModel("diffrt.engine.models.tiny.wan:build_tiny_wan_folder",
                              {"seed": 1, "two_experts": True},
                              {"height": 64, "width": 64, "num_inference_steps": 4,
                               "num_frames": 9},
                              cache={"teacache_rescale": TINY_WAN_TEACACHE}),
    # its image-to-video layout: the first frame as 20 condition channels
    "tiny-wan-i2v": EmbeddedModel("diffrt.engine.models.tiny.wan:build_tiny_wan_folder",
                                  {"seed": 1, "i2v": True, "two_experts": True},
                                  {"height": 64, "width": 64, "num_inference_steps": 4,
                                   "num_frames": 9}),
    # LTX-2-style text-to-video with sound: 9 frames of 32 x 32 px and their
    # waveform (16 kHz stereo), not 121 of 512 x 768; prompts padded to 128
    "tiny-ltx2": EmbeddedModel("diffrt.engine.models.tiny.ltx2:build_tiny_ltx2_folder",
                               {"seed": 1},
                               {"height": 32, "width": 32, "num_inference_steps": 4,
                                "num_frames": 9}),
    # its image-to-video layout (LTX2ImageToVideoPipeline): the same weights,
    # the first frame given
    "tiny-ltx2-i2v": EmbeddedModel("diffrt.engine.models.tiny.ltx2:build_tiny_ltx2_folder",
                                   {"seed": 1, "i2v": True},
                                   {"height": 32, "width": 32, "num_inference_steps": 4,
                                    "num_frames": 9}),
    # Helios-style long video in chunks: chunks of 2 latent frames (5 frames,
    # not 9 and 33), 2 steps each; 9 frames of 32 x 32 px are 2 chunks
    "tiny-helios": EmbeddedModel("diffrt.engine.models.tiny.helios:build_tiny_helios_folder",
                                 {"seed": 1},
                                 {"height": 32, "width": 32, "num_inference_steps": 2,
                                  "num_frames": 9},
                                 {"chunk_latent_frames": 2}),
}

_VERSIONED = ("torch", "diffusers", "transformers", "tokenizers", "safetensors")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def builder_sources(name: str) -> tuple[str, ...]:
    """The files whose source builds embedded model ``name``: its builder's
    module and the diffrt modules it imports (``module_sources``), then the
    shared ``tiny/shared.py``. Finds them without running them (no import of
    torch or diffusers)."""
    module = EMBEDDED_MODELS[name].builder.partition(":")[0]
    if _find_spec(module) is None:
        raise ModelLoadError(f"{name}: its builder's module {module} cannot be found")
    return tuple(dict.fromkeys((*module_sources(module), SHARED_SOURCE)))


def module_sources(module: str) -> tuple[str, ...]:
    """``module``'s file, then those of the diffrt modules it imports, and
    those they import, depth first, each once: a builder that takes its
    pieces from another family's builder (the Qwen-Image-Edit folder from the
    Qwen-Image one) keys on both. Imports are read from the source (``ast``),
    wherever they stand (in a function too); a package's ``__init__`` counts
    only where a name is imported from the package itself."""
    found: dict[str, None] = {}

    def visit(name: str) -> None:
        spec = _find_spec(name)
        if spec is None or not spec.origin or spec.origin in found:
            return
        found[spec.origin] = None
        with open(spec.origin, "rb") as f:
            tree = ast.parse(f.read(), filename=spec.origin)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                    spec.parent)
                        if node.level else node.module or "")
                targets = [_imported_module(base, alias.name) for alias in node.names
                           if _in_diffrt(base)]
            else:
                continue
            for target in targets:
                if _in_diffrt(target):
                    visit(target)

    visit(module)
    return tuple(found)


def _in_diffrt(name: str) -> bool:
    return name == "diffrt" or name.startswith("diffrt.")


def _imported_module(base: str, name: str) -> str:
    """The module ``from base import name`` reads: ``base.name`` where that
    is a submodule of package ``base``, else ``base`` (found without running
    ``base`` unless it is a package, whose ``__init__`` then runs)."""
    spec = _find_spec(base)
    if spec is not None and spec.submodule_search_locations is not None:
        if _find_spec(f"{base}.{name}") is not None:
            return f"{base}.{name}"
    return base


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except ImportError:  # a parent package that is missing or fails to import
        return None


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Build on one torch thread: the builders' float arithmetic then rounds
    the same in every process (a worker on one thread, a test on two), so the
    same key always means the same bytes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def folder_key(name: str) -> str:
    """12 hex digits naming what a folder was built from (no import of the libraries)."""
    return _folder_key(name, builder_sources(name))


@functools.cache
def _folder_key(name: str, source_paths: tuple[str, ...]) -> str:
    """Computed once per process: every resolution of an embedded name asks for
    it, and reading the builders' source and five distributions' metadata each
    time would be wasted (neither changes while the process runs). The
    sources count by content, not by path, so two installs of one release
    share a folder."""
    model = EMBEDDED_MODELS[name]
    sources = []
    for path in source_paths:
        with open(path, "rb") as f:
            sources.append(hashlib.sha256(f.read()).hexdigest())
    blob = json.dumps({"sources": sources, "name": name, "builder": model.builder,
                       "kwargs": model.kwargs,
                       "versions": {d: _version(d) for d in _VERSIONED}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def embedded_folder(name: str) -> str:
    """The folder of embedded model ``name``, built first if this cache lacks it.

    Raises ModelLoadError naming the cache when it cannot be written, or when a
    folder of that name exists but is not a model (to be deleted by hand).
    """
    model = EMBEDDED_MODELS[name]
    root = os.path.join(cache_dir(), "models")
    final = os.path.join(root, f"{name}-{folder_key(name)}")
    if os.path.isfile(os.path.join(final, "model_index.json")):
        return final
    if os.path.exists(final):
        raise ModelLoadError(f"{final}: not a model folder (no model_index.json); delete it "
                             f"and diffrt writes {name} again")
    from diffrt.engine.models.family import load_object
    from diffrt.engine.models.loading import library_bars_off

    try:
        os.makedirs(root, exist_ok=True)
        _remove_stale_builds(root, name)
        tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=root)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the embedded model {name} into {root} "
                             f"({exc.strerror or exc}); set DIFFRT_CACHE_DIR to a writable "
                             "folder") from None
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model from other users
    try:
        logger.info("writing embedded model %s to %s", name, final)
        with library_bars_off(), _one_thread():
            load_object(model.builder)(tmp, **model.kwargs)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "model_index.json")):
                raise
            # Another process renamed its copy first: same bytes, keep theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_stale_builds(root: str, name: str) -> None:
    """Temporary folders of builds killed midway (a worker past its start-up
    timeout); a build in progress is younger than ``STALE_BUILD_S``."""
    now = time.time()
    for entry in os.scandir(root):
        if entry.name.startswith(f".{name}-") and entry.is_dir(follow_symlinks=False):
            try:
                if now - entry.stat().st_mtime > STALE_BUILD_S:
                    shutil.rmtree(entry.path, ignore_errors=True)
            except OSError:
                pass
