"""A request's input images: checked and converted at submission, carried by
handle, read back in the worker.

What a request may give (``DiffusionRequest.images`` and ``mask_image``):
``PIL.Image.Image`` objects, or numpy arrays holding one (uint8 ``(H, W)``,
``(H, W, 1|3|4)``; float or bool arrays in [0, 1] are scaled by 255 and
rounded). Each becomes what diffusers' ``VaeImageProcessor`` makes of a PIL
image, up to the point where pixels turn into floats:

* an image: RGB (``convert("RGB")`` as ``diffusers.utils.load_image``
  converts: an alpha channel is dropped, CMYK, YCbCr and palette images are
  converted by PIL; 16-bit grayscale is scaled to 8 bits first; 32-bit
  integer and float modes are refused), resized to the request's size with
  Lanczos (the processor's ``resize``), as ``(H, W, 3)`` uint8;
* a mask: grayscale (``convert("L")``, as the mask processor's
  ``do_convert_grayscale``), resized the same way, as ``(H, W)`` uint8; the
  worker binarises it at one half, as the mask processor does (white:
  repaint). It must be as large as the image it masks.

An animated image gives its current frame (the first, when it was just
opened), as PIL's own conversion does. The arrays go into the executor's
input arena (``runtime.input_arena``) and the request travels with their
handles; the worker turns the uint8 values into the floats diffusers would
have (``/ 255``, then ``2x - 1`` for an image) with the same float32 steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import msgspec
import numpy as np

from diffrt.engine.sampling import InvalidRequestError
from diffrt.runtime.input_arena import InputArena, InputHandle, read_input
from diffrt.runtime.shm_transport import ALIGN, Arena

if TYPE_CHECKING:
    import PIL.Image
    import torch
    from diffusers.image_processor import VaeImageProcessor


class WithInputs(Protocol):
    """A request as this module reads it: its input images and mask, as given
    or as stored (``DiffusionRequest``; named by shape, not imported, since
    the request checks its inputs here)."""

    @property
    def images(self) -> list: ...
    @property
    def mask_image(self) -> object: ...


#: the request ``store`` gives back with its inputs stored (a ``DiffusionRequest``)
Request = TypeVar("Request", bound=msgspec.Struct)

#: the most images one request may give (a model may take fewer: its spec's
#: ``max_input_images``)
MAX_INPUT_IMAGES = 4
#: the largest input image, in pixels (before it is resized): 64 MiB as RGBA
MAX_INPUT_PIXELS = 4096 * 4096

#: PIL modes taken as 16-bit grayscale (scaled to 8 bits, then converted)
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")
#: PIL modes no 8-bit conversion keeps the meaning of
_REFUSED_MODES = ("I", "F")


@dataclass
class InputPixels:
    """One request's inputs as the worker reads them: uint8 CPU tensors,
    images ``(H, W, 3)``, the mask ``(H, W)``."""

    images: list[torch.Tensor]
    mask: torch.Tensor | None = None
    #: the images as the text encoder reads them, where the model reads them
    #: at another size (Qwen-Image-Edit Plus)
    prompt_images: list[torch.Tensor] | None = None


def _is_image(value: object) -> bool:
    try:
        import PIL.Image
    except ImportError:  # pragma: no cover - Pillow comes with diffusers
        return False
    return isinstance(value, PIL.Image.Image)


def check_kinds(images: object, mask: object) -> None:
    """Refuse, naming the field, inputs that are not images at all (the
    request's own ``validate``; sizes and modes are ``to_arrays``'). A
    ``StoredImage`` is the engine's, never a submission's: one given would
    name another request's slot."""
    if not isinstance(images, list):
        raise InvalidRequestError("images", f"must be a list, got {type(images).__name__}")
    if len(images) > MAX_INPUT_IMAGES:
        raise InvalidRequestError("images", f"at most {MAX_INPUT_IMAGES} images, "
                                            f"got {len(images)}")
    for i, image in enumerate(images):
        if not (_is_image(image) or isinstance(image, np.ndarray)):
            raise InvalidRequestError(f"images[{i}]", "must be a PIL.Image or a numpy array, "
                                                      f"got {type(image).__name__}")
    if mask is not None and not (_is_image(mask) or isinstance(mask, np.ndarray)):
        raise InvalidRequestError("mask_image", "must be a PIL.Image, a numpy array or None, "
                                                f"got {type(mask).__name__}")
    if mask is not None and not images:
        raise InvalidRequestError("mask_image", "a mask needs an image to mask (images)")


def _as_pil(value: PIL.Image.Image | np.ndarray, field: str) -> PIL.Image.Image:
    """A PIL image of ``value`` (a PIL image or a numpy array), checked for size."""
    import PIL.Image

    if isinstance(value, np.ndarray):
        array = value
        if array.dtype == np.bool_ or np.issubdtype(array.dtype, np.floating):
            if array.size and not (np.isfinite(array).all() and array.min() >= 0
                                   and array.max() <= 1):
                raise InvalidRequestError(field, "a float array must hold values in [0, 1]")
            array = np.round(array.astype(np.float64) * 255).astype(np.uint8)
        elif array.dtype != np.uint8:
            raise InvalidRequestError(field, f"arrays must be uint8, bool or float, "
                                             f"got {array.dtype}")
        if array.ndim == 3 and array.shape[2] == 1:
            array = array[:, :, 0]
        if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
            raise InvalidRequestError(field, "an array must be (H, W) or (H, W, 1|3|4), "
                                             f"got shape {tuple(array.shape)}")
        value = PIL.Image.fromarray(np.ascontiguousarray(array))
    width, height = value.size
    if width < 1 or height < 1:
        raise InvalidRequestError(field, f"an image with no pixels ({width}x{height})")
    if width * height > MAX_INPUT_PIXELS:
        raise InvalidRequestError(field, f"{width}x{height} is more than {MAX_INPUT_PIXELS} "
                                         "pixels")
    return value


def _converted(image: PIL.Image.Image, field: str, mode: str) -> PIL.Image.Image:
    """``image`` in ``mode`` ("RGB" or "L"), converted as described above (a
    file that cannot be decoded is refused naming ``field``)."""
    import PIL.Image

    if image.mode in _REFUSED_MODES:
        raise InvalidRequestError(field, (
            f"PIL mode {image.mode!r} (32-bit) has no one 8-bit meaning; convert it to an "
            "8-bit image first"))
    try:
        if image.mode in _SIXTEEN_BIT:
            values = np.asarray(image, dtype=np.uint16)
            image = PIL.Image.fromarray((values >> 8).astype(np.uint8))
        return image if image.mode == mode else image.convert(mode)
    except OSError as exc:  # a truncated or corrupt file behind a lazy PIL image
        raise InvalidRequestError(field, f"cannot be decoded ({exc})") from None


#: the least side (px) and the largest aspect ratio of an input's resized
#: copies: Qwen2-VL's image processor refuses beyond them (``smart_resize``)
MIN_INPUT_SIDE = 28
MAX_INPUT_ASPECT = 200


def _checked_size(size: tuple[int, int], field: str) -> tuple[int, int]:
    height, width = size
    if min(height, width) < MIN_INPUT_SIDE or max(height, width) >= MAX_INPUT_ASPECT * min(
            height, width):
        raise InvalidRequestError(field, (
            f"would be resized to {width}x{height}: each side at least {MIN_INPUT_SIDE} px "
            f"and the aspect ratio below {MAX_INPUT_ASPECT}"))
    return size


@functools.cache
def _resizer() -> VaeImageProcessor:
    """diffusers' image processor, made on first use (importing diffusers is slow)."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor()


def _resize(image: PIL.Image.Image, height: int, width: int) -> PIL.Image.Image:
    """diffusers' own resize of a PIL image (its processor's defaults: Lanczos)."""
    return _resizer().resize(image, height, width)


#: (width, height) of an input -> the (height, width) it is resized to
SizeRule = Callable[[int, int], tuple[int, int]]


class Converted(msgspec.Struct):
    """One request's inputs, converted (``to_arrays``): uint8 arrays, images
    ``(H, W, 3)`` at the size the model takes them, the mask ``(H, W)``, and
    for a model whose text encoder reads its images at another size (the
    spec's ``prompt_image_size``) those copies too."""

    images: list[np.ndarray]
    mask: np.ndarray | None = None
    prompt_images: list[np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        """The arena bytes they take (each slot rounded up to its alignment)."""
        arrays = [*self.images, *(self.prompt_images or []), self.mask]
        return sum(-(-max(a.nbytes, 1) // ALIGN) * ALIGN for a in arrays if a is not None)


def to_arrays(images: list[PIL.Image.Image | np.ndarray],
              mask: PIL.Image.Image | np.ndarray | None, size_of: SizeRule,
              prompt_size_of: SizeRule | None = None) -> Converted:
    """The request's inputs converted (see the module docstring), each
    resized to the size ``size_of`` gives for its own (the model's
    ``ModelSpec.input_size``), and to ``prompt_size_of``'s for the text
    encoder when given; InvalidRequestError names the input that cannot be
    taken."""
    pils = [_as_pil(image, f"images[{i}]") for i, image in enumerate(images)]
    rgb = [_converted(p, f"images[{i}]", "RGB") for i, p in enumerate(pils)]
    arrays = [np.asarray(_resize(image, *_checked_size(size_of(*image.size), f"images[{i}]")),
                         dtype=np.uint8) for i, image in enumerate(rgb)]
    prompt_arrays = None if prompt_size_of is None else [
        np.asarray(_resize(image, *_checked_size(prompt_size_of(*image.size), f"images[{i}]")),
                   dtype=np.uint8) for i, image in enumerate(rgb)]
    mask_array = None
    if mask is not None:
        pil = _as_pil(mask, "mask_image")
        if pils and pil.size != pils[0].size:
            raise InvalidRequestError("mask_image", (
                f"is {pil.size[0]}x{pil.size[1]}, the image it masks "
                f"{pils[0].size[0]}x{pils[0].size[1]}: they must be the same size"))
        mask_array = np.asarray(_resize(_converted(pil, "mask_image", "L"), *size_of(*pil.size)),
                                dtype=np.uint8)
    return Converted(arrays, mask_array, prompt_arrays)


class StoredImage(msgspec.Struct, frozen=True, tag="stored_image"):
    """A request input in the input arena: the image as the model takes it,
    and (a model whose text encoder reads it at another size) that copy."""

    image: InputHandle
    prompt_image: InputHandle | None = None

    def handles(self) -> list[InputHandle]:
        return [self.image] + ([self.prompt_image] if self.prompt_image is not None else [])


def stored_shape(item: object) -> tuple[int, int] | None:
    """(height, width) of a stored input (already resized), None for one as given."""
    stored = _stored(item)
    return (stored.image.shape[0], stored.image.shape[1]) if stored is not None else None


def pixel_size(item: object) -> tuple[int, int]:
    """(width, height) of an input as given (a PIL image or an array)."""
    if isinstance(item, np.ndarray):
        return (int(item.shape[1]), int(item.shape[0])) if item.ndim >= 2 else (0, 0)
    size = getattr(item, "size", None)
    return (int(size[0]), int(size[1])) if isinstance(size, tuple) else (0, 0)


def store(request: Request, converted: Converted, inputs: InputArena) -> Request:
    """``request`` with its inputs replaced by ``StoredImage``s in ``inputs``
    (all or none: a failure frees what was written)."""
    written: list[InputHandle] = []

    def put(array: np.ndarray) -> InputHandle:
        written.append(inputs.put(array))
        return written[-1]

    try:
        prompts: list[np.ndarray | None] = (list(converted.prompt_images or [])
                                            or [None] * len(converted.images))
        images = [StoredImage(put(a), put(p) if p is not None else None)
                  for a, p in zip(converted.images, prompts, strict=True)]
        mask = StoredImage(put(converted.mask)) if converted.mask is not None else None
    except BaseException:
        for handle in written:
            inputs.free(handle)
        raise
    return msgspec.structs.replace(request, images=images, mask_image=mask)


def _all_stored(request: WithInputs) -> list[StoredImage]:
    items = [_stored(item) for item in [*request.images, request.mask_image]]
    return [item for item in items if item is not None]


def release(request: WithInputs, inputs: InputArena | None) -> None:
    """Free the input slots of a request that has ended (or never ran)."""
    if inputs is None:
        return
    for stored in _all_stored(request):
        for handle in stored.handles():
            inputs.free(handle)


def _stored(item: object) -> StoredImage | None:
    """A stored input: as sent, or as a worker decodes it (the request's input
    fields are untyped: a user gives images there)."""
    if isinstance(item, dict) and item.get("type") == "stored_image":
        return msgspec.convert(item, StoredImage)
    return item if isinstance(item, StoredImage) else None


def read_pixels(request: WithInputs, arena: Arena | None, size_of: SizeRule,
                prompt_size_of: SizeRule | None = None) -> InputPixels | None:
    """The worker's copy of a request's inputs (None without any): read from
    ``arena``, or converted here (to the sizes the rules say) when the request
    still holds images (a pipeline called directly, without an engine)."""
    import torch

    if not request.images:
        return None
    stored = [_stored(item) for item in request.images]
    if stored[0] is not None:
        if arena is None:
            raise RuntimeError("a request with input images reached a worker without "
                               "the input arena")
        mask = _stored(request.mask_image)
        prompts = [read_input(arena, s.prompt_image) for s in stored
                   if s is not None and s.prompt_image is not None]
        return InputPixels([read_input(arena, s.image) for s in stored if s is not None],
                           read_input(arena, mask.image) if mask is not None else None,
                           prompts or None)
    # not stored: the request's own inputs, as check_kinds took them
    given = cast("PIL.Image.Image | np.ndarray | None", request.mask_image)
    converted = to_arrays(list(request.images), given, size_of, prompt_size_of)

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array.copy())

    return InputPixels([tensor(a) for a in converted.images],
                       None if converted.mask is None else tensor(converted.mask),
                       None if converted.prompt_images is None else
                       [tensor(a) for a in converted.prompt_images])


__all__ = ["MAX_INPUT_IMAGES", "MAX_INPUT_PIXELS", "Converted", "InputPixels", "SizeRule",
           "StoredImage", "check_kinds", "pixel_size", "read_pixels", "release",
           "store", "stored_shape", "to_arrays"]
