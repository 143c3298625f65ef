"""The synthetic world of the video demo model ``diffrt-motion``: clips of one
moving shape, their prompts, and a deterministic classifier that reads a
clip back.

A clip is ``FRAMES`` frames of 64x64: one shape (circle, square, triangle) of
one of six colours on a plain background of another (the nine of
``diffrt.demo.shapes``), doing one of seven things — moving left to right,
right to left, top to bottom, bottom to top, growing, shrinking, or standing
still. Its prompt says all four, in one small grammar:

    a red circle moving left to right on a yellow background
    a blue square growing on a white background

That is 3 x 6 x 8 x 7 = 1008 combinations; ``HELD_OUT`` (about 11 %, chosen
by a fixed hash of the prompt, as the picture world's) are never trained on,
and the evaluation asks for them. Training clips are jittered (start, speed,
size, the other axis) so the model learns motions, not pixel paths.

The classifier needs no model. Per frame, as the picture world's: the
background is the palette colour nearest to the median of the border pixels
(of the whole clip), the shape's pixels those nearer another palette colour,
their vote the colour. The shape is read from the frame where it is largest
(fill of its bounding box: square ≈ 1, circle ≈ π/4, triangle ≈ 1/2); the
direction from the track of its centroid and area between the first and the
last frames: an area that changes by half or more is growing or shrinking, a
centroid that moves less than ``STILL_PIXELS`` is standing still, else the
axis and sign of the larger move.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from diffrt.demo.shapes import BACKGROUNDS, COLOURS, PALETTE, SHAPES, SIZE

#: frames of a clip (the first frame, then 4 pairs: diffrt-motion's VAE
#: compresses time 2x; 4k + 1 also fits Wan's usual 4x)
FRAMES = 9
#: name -> (dx, dy) per clip of a moving shape's centre (unit), or the
#: change of its size (growing / shrinking), or nothing (standing still)
DIRECTIONS = ("left to right", "right to left", "top to bottom", "bottom to top",
              "growing", "shrinking", "standing still")
_MOVES = {"left to right": (1, 0), "right to left": (-1, 0), "top to bottom": (0, 1),
          "bottom to top": (0, -1)}
#: a shape's bounding-box side while it moves or stands
SHAPE_SIZE = 18
#: a moving shape's centre travels from TRAVEL[0] to TRAVEL[1] (pixels, along its axis)
TRAVEL = (14.0, 50.0)
#: a growing shape's side goes from GROWTH[0] to GROWTH[1] (shrinking: back)
GROWTH = (10.0, 34.0)
#: a centroid that moves less than this over the clip stands still
STILL_PIXELS = 8.0


@dataclass(frozen=True)
class Clip:
    """One combination of the world (what a prompt asks for)."""

    shape: str
    colour: str
    background: str
    direction: str

    @property
    def prompt(self) -> str:
        return f"a {self.colour} {self.shape} {verb(self.direction)} on a {self.background} background"


def verb(direction: str) -> str:
    """What a prompt says of ``direction``: "moving left to right", "growing"."""
    return f"moving {direction}" if direction in _MOVES else direction


def all_clips() -> list[Clip]:
    """Every valid combination (the shape's colour differs from the background)."""
    return [Clip(s, c, b, d) for s, c, b, d in itertools.product(
        SHAPES, COLOURS, BACKGROUNDS, DIRECTIONS) if c != b]


def _held_out(clip: Clip) -> bool:
    digest = hashlib.sha256(("motion:" + clip.prompt).encode()).digest()
    return digest[0] < 28  # 28/256 ≈ 11 %


HELD_OUT = [c for c in all_clips() if _held_out(c)]
TRAIN = [c for c in all_clips() if not _held_out(c)]
#: the 30 held-out prompts the model card's figures are measured on (spread over the list)
EVALUATION = HELD_OUT[::len(HELD_OUT) // 30][:30]


@dataclass(frozen=True)
class Variation:
    """How one drawing of a clip departs from the plain one: the centre's
    offset across its path (or from the middle, if it does not move), the
    path's shift along it, a speed factor and a size factor."""

    across: float = 0.0
    along: float = 0.0
    speed: float = 1.0
    scale: float = 1.0


def random_variation(rng: np.random.Generator) -> Variation:
    return Variation(*(float(x) for x in (rng.uniform(-8, 8), rng.uniform(-3, 3),
                                          rng.uniform(0.8, 1.0), rng.uniform(0.85, 1.15))))


def _draw(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, side: float,
          colour: tuple[int, int, int]) -> None:
    half = side / 2
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)],
                     fill=colour)


def render(clip: Clip, variation: Variation = Variation(), frames: int = FRAMES) -> np.ndarray:
    """The clip's frames, (frames, 64, 64, 3) uint8."""
    out = np.empty((frames, SIZE, SIZE, 3), dtype=np.uint8)
    middle = SIZE / 2
    for k in range(frames):
        t = k / (frames - 1)
        image = Image.new("RGB", (SIZE, SIZE), PALETTE[clip.background])
        side = SHAPE_SIZE * variation.scale
        cx = cy = middle
        if clip.direction in _MOVES:
            dx, dy = _MOVES[clip.direction]
            span = (TRAVEL[1] - TRAVEL[0]) * variation.speed
            along = middle + variation.along + (t - 0.5) * span
            across = middle + variation.across
            cx, cy = (along if dx > 0 else SIZE - along, across) if dx else (
                across, along if dy > 0 else SIZE - along)
        elif clip.direction in ("growing", "shrinking"):
            small, large = GROWTH
            grow = t if clip.direction == "growing" else 1 - t
            side = (small + (large - small) * grow * variation.speed) * variation.scale
            cx, cy = middle + variation.across / 2, middle + variation.along
        else:
            cx, cy = middle + variation.across, middle + variation.along * 2
        _draw(ImageDraw.Draw(image), clip.shape, cx, cy, side, PALETTE[clip.colour])
        out[k] = np.asarray(image)
    return out


def random_render(clip: Clip, rng: np.random.Generator, frames: int = FRAMES) -> np.ndarray:
    return render(clip, random_variation(rng), frames)


# -- the classifier ------------------------------------------------------------------
_NAMES = list(PALETTE)
_RGB = np.array([PALETTE[n] for n in _NAMES], dtype=np.float32)


def _nearest(pixels: np.ndarray) -> np.ndarray:
    """Index into ``_NAMES`` of the nearest palette colour of each (N, 3)
    pixel (channel by channel in float32: a clip is 36,864 pixels)."""
    pixels = np.asarray(pixels, dtype=np.float32)
    distance = np.zeros((len(pixels), len(_RGB)), dtype=np.float32)
    for c in range(3):
        distance += (pixels[:, c, None] - _RGB[None, :, c]) ** 2
    return np.argmin(distance, axis=1)


@dataclass(frozen=True)
class Reading:
    """What the classifier sees in a clip; None where it sees no shape."""

    background: str
    colour: str | None
    shape: str | None
    direction: str | None


def _fill_shape(mask: np.ndarray) -> str:
    ys, xs = np.nonzero(mask)
    fill = mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    return "square" if fill > 0.9 else "circle" if fill > 0.64 else "triangle"


def classify(frames: np.ndarray) -> Reading:
    """Read a clip back: ``frames`` is (F, H, W, 3) uint8 (or floats in 0..255)."""
    pixels = np.asarray(frames, dtype=np.float32)
    f, h, w, _ = pixels.shape
    border = np.concatenate([pixels[:, 0].reshape(-1, 3), pixels[:, -1].reshape(-1, 3),
                             pixels[:, :, 0].reshape(-1, 3), pixels[:, :, -1].reshape(-1, 3)])
    background = _NAMES[_nearest(np.median(border, axis=0, keepdims=True))[0]]
    labels = _nearest(pixels.reshape(-1, 3)).reshape(f, h, w)
    mask = labels != _NAMES.index(background)
    if mask.sum() < 20 * f:  # a few stray pixels a frame are not a shape
        return Reading(background, None, None, None)
    votes = np.bincount(labels[mask], minlength=len(_NAMES))
    colour = _NAMES[int(np.argmax(votes))]
    shape_mask = labels == _NAMES.index(colour)
    areas = shape_mask.reshape(f, -1).sum(1)
    seen = np.nonzero(areas >= 10)[0]
    if len(seen) < 2:
        return Reading(background, colour, None, None)
    shape = _fill_shape(shape_mask[int(np.argmax(areas))])
    first, last = int(seen[0]), int(seen[-1])
    centroids = [np.argwhere(shape_mask[k]).mean(0) for k in (first, last)]  # (y, x)
    dy, dx = centroids[1] - centroids[0]
    ratio = areas[last] / areas[first]
    if ratio >= 1.5 or ratio <= 1 / 1.5:
        direction = "growing" if ratio > 1 else "shrinking"
    elif max(abs(dx), abs(dy)) < STILL_PIXELS:
        direction = "standing still"
    elif abs(dx) >= abs(dy):
        direction = "left to right" if dx > 0 else "right to left"
    else:
        direction = "top to bottom" if dy > 0 else "bottom to top"
    return Reading(background, colour, shape, direction)


#: what a prompt asks for and the classifier reads back
ATTRIBUTES = ("direction", "colour", "background", "shape")


def score(clip: Clip, reading: Reading) -> dict[str, bool]:
    """Which of the prompt's four attributes the clip shows."""
    return {"direction": reading.direction == clip.direction,
            "colour": reading.colour == clip.colour,
            "background": reading.background == clip.background,
            "shape": reading.shape == clip.shape}


def tally(clips: list[Clip], videos: list[np.ndarray]) -> dict[str, int]:
    """Per attribute, how many of the videos show what their clip's prompt asked for."""
    hits = dict.fromkeys(ATTRIBUTES, 0)
    for clip, video in zip(clips, videos, strict=True):
        for name, ok in score(clip, classify(video)).items():
            hits[name] += ok
    return hits


__all__ = ["ATTRIBUTES", "DIRECTIONS", "EVALUATION", "FRAMES", "HELD_OUT", "TRAIN", "Clip",
           "Reading", "Variation", "all_clips", "classify", "random_render",
           "random_variation", "render", "score", "tally", "verb"]
