"""What the shipped demo model ``diffrt-shapes`` is asked in tests, and how
its answers are judged: the deterministic classifier of ``diffrt.demo.shapes``
reads colour, shape, place and background back from each picture, and a test
asserts per-attribute pass rates with a margin below the model card's
held-out accuracy (robust to float noise across torch builds, not
pixel-exact). Imported as ``from shape_checks import ...`` (pyproject puts
tests/ on ``sys.path``)."""

from __future__ import annotations

from PIL import Image

from diffrt.demo import shapes

#: four held-out combinations (never trained on) and four seen ones, each
#: shape at least twice, spread over colours, backgrounds and places
SCENES = [*shapes.HELD_OUT[5::36], *shapes.TRAIN[100::283]]
#: the README's demo prompt: "a red circle on a yellow background in the top left"
DEMO = shapes.Scene("circle", "red", "yellow", "top left")
#: of the 8 scenes, how many must show each attribute (the model card's
#: held-out accuracy makes about 8 of 8 expected for each)
MINIMUM = {"colour": 7, "shape": 6, "position": 7, "background": 7}


def assert_drawn(scenes: list[shapes.Scene], images: list[Image.Image],
                 minimum: dict[str, int] | None = None) -> None:
    """Each attribute read back from at least ``minimum`` of the pictures
    (default: MINIMUM, for the 8 SCENES)."""
    minimum = minimum or MINIMUM
    hits = shapes.tally(scenes, images)
    readings = [f"{s.prompt!r}: {shapes.classify(im)}"
                for s, im in zip(scenes, images, strict=True)]
    assert all(hits[k] >= minimum[k] for k in minimum), (hits, readings)
