"""The synthetic world of the demo model: pictures of one shape, their prompts,
and a small deterministic classifier that reads a picture back.

A picture is 64x64: one shape (circle, square, triangle) of one colour on a
plain background of another, in one of nine places (a 3x3 grid). Its prompt
says all four: "a red circle on a yellow background in the top left".
``HELD_OUT`` combinations (about 11 %, chosen by a fixed hash) are never
trained on; the evaluation asks for them.

The classifier judges a generated picture against its prompt without any
model: the background is the palette colour nearest to the median of the
border pixels; the shape's pixels are those nearer another palette colour;
its colour is their vote, its position the cell of their centroid, its
shape the fill of their bounding box (square ≈ 1, circle ≈ π/4, triangle
≈ 1/2).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64
SHAPES = ("circle", "square", "triangle")
#: name -> RGB (well apart, so a pixel vote is unambiguous)
PALETTE = {
    "red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220),
    "yellow": (240, 220, 40), "purple": (140, 50, 180), "orange": (245, 140, 20),
    "white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128),
}
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
BACKGROUNDS = ("white", "black", "gray", "red", "green", "blue", "yellow", "purple", "orange")
#: name -> (row, column) of the 3x3 grid
POSITIONS = {
    "top left": (0, 0), "top middle": (0, 1), "top right": (0, 2),
    "middle left": (1, 0), "center": (1, 1), "middle right": (1, 2),
    "bottom left": (2, 0), "bottom middle": (2, 1), "bottom right": (2, 2),
}
#: a shape's extent in pixels (its bounding box side)
SHAPE_SIZE = 20


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str
    position: str

    @property
    def prompt(self) -> str:
        return f"a {self.colour} {self.shape} on a {self.background} background in the {self.position}"


def all_scenes() -> list[Scene]:
    """Every valid combination (the shape's colour differs from the background)."""
    return [Scene(s, c, b, p) for s, c, b, p in itertools.product(
        SHAPES, COLOURS, BACKGROUNDS, POSITIONS) if c != b]


def _held_out(scene: Scene) -> bool:
    digest = hashlib.sha256(scene.prompt.encode()).digest()
    return digest[0] < 28  # 28/256 ≈ 11 %


HELD_OUT = [s for s in all_scenes() if _held_out(s)]
TRAIN = [s for s in all_scenes() if not _held_out(s)]


def cell_centre(position: str) -> tuple[float, float]:
    row, col = POSITIONS[position]
    step = SIZE / 3
    return (col + 0.5) * step, (row + 0.5) * step


def render(scene: Scene, jitter: tuple[float, float] = (0.0, 0.0), scale: float = 1.0) -> Image.Image:
    """The picture of ``scene`` (``jitter`` moves the shape a few pixels within
    its cell and ``scale`` resizes it a little, for training variety)."""
    image = Image.new("RGB", (SIZE, SIZE), PALETTE[scene.background])
    draw = ImageDraw.Draw(image)
    cx, cy = cell_centre(scene.position)
    cx, cy = cx + jitter[0], cy + jitter[1]
    half = SHAPE_SIZE * scale / 2
    box = (cx - half, cy - half, cx + half, cy + half)
    colour = PALETTE[scene.colour]
    if scene.shape == "circle":
        draw.ellipse(box, fill=colour)
    elif scene.shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=colour)
    return image


def random_render(scene: Scene, rng: np.random.Generator) -> Image.Image:
    dx, dy = (float(x) for x in rng.uniform(-3, 3, size=2))
    return render(scene, (dx, dy), float(rng.uniform(0.85, 1.15)))


# -- the classifier ------------------------------------------------------------------
_NAMES = list(PALETTE)
_RGB = np.array([PALETTE[n] for n in _NAMES], dtype=np.float64)


def _nearest(pixels: np.ndarray) -> np.ndarray:
    """Index into ``_NAMES`` of the nearest palette colour of each (N, 3) pixel."""
    return np.argmin(((pixels[:, None, :] - _RGB[None]) ** 2).sum(-1), axis=1)


@dataclass(frozen=True)
class Reading:
    """What the classifier sees; None where it sees nothing (no shape)."""

    background: str
    colour: str | None
    shape: str | None
    position: str | None


def classify(image: Image.Image | np.ndarray) -> Reading:
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image,
                        dtype=np.float64)
    h, w, _ = pixels.shape
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    background = _NAMES[_nearest(np.median(border, axis=0, keepdims=True))[0]]
    labels = _nearest(pixels.reshape(-1, 3)).reshape(h, w)
    mask = labels != _NAMES.index(background)
    if mask.sum() < 20:  # a few stray pixels are not a shape
        return Reading(background, None, None, None)
    votes = np.bincount(labels[mask], minlength=len(_NAMES))
    colour = _NAMES[int(np.argmax(votes))]
    shape_mask = labels == _NAMES.index(colour)
    ys, xs = np.nonzero(shape_mask)
    cy, cx = ys.mean(), xs.mean()
    row, col = min(2, int(cy * 3 / h)), min(2, int(cx * 3 / w))
    position = next(n for n, rc in POSITIONS.items() if rc == (row, col))
    box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
    fill = shape_mask.sum() / box
    shape = "square" if fill > 0.9 else "circle" if fill > 0.64 else "triangle"
    return Reading(background, colour, shape, position)


#: what a prompt asks for and the classifier reads back
ATTRIBUTES = ("colour", "shape", "position", "background")


def score(scene: Scene, reading: Reading) -> dict[str, bool]:
    """Which of the prompt's four attributes the picture shows."""
    return {"colour": reading.colour == scene.colour, "shape": reading.shape == scene.shape,
            "position": reading.position == scene.position,
            "background": reading.background == scene.background}


def tally(scenes: list[Scene], images: list[Image.Image | np.ndarray]) -> dict[str, int]:
    """Per attribute, how many of the pictures show what their scene's prompt asked for."""
    hits = dict.fromkeys(ATTRIBUTES, 0)
    for scene, image in zip(scenes, images, strict=True):
        for name, ok in score(scene, classify(image)).items():
            hits[name] += ok
    return hits


__all__ = ["ATTRIBUTES", "BACKGROUNDS", "COLOURS", "HELD_OUT", "PALETTE", "POSITIONS", "SHAPES", "SIZE",
           "TRAIN", "Reading", "Scene", "all_scenes", "classify", "random_render", "render",
           "score", "tally"]
