"""The demo world's classifier reads every rendered scene back exactly (clean
and with the training jitter), refuses an empty picture, and the held-out
split is fixed and about a ninth of the combinations."""

from __future__ import annotations

import numpy as np
from PIL import Image

from diffrt.demo.shapes import (
    HELD_OUT,
    PALETTE,
    TRAIN,
    Scene,
    all_scenes,
    classify,
    random_render,
    render,
    score,
    tally,
)


def test_every_scene_is_read_back_as_its_prompt_says():
    rng = np.random.default_rng(0)
    for scene in all_scenes():
        for image in (render(scene), random_render(scene, rng)):
            assert all(score(scene, classify(image)).values()), scene.prompt


def test_a_picture_without_a_shape_has_none():
    reading = classify(Image.new("RGB", (64, 64), PALETTE["gray"]))
    assert reading.background == "gray" and reading.shape is None and reading.colour is None


def test_the_held_out_split_is_fixed():
    assert len(all_scenes()) == 1296 and len(HELD_OUT) == 146
    assert not set(HELD_OUT) & set(TRAIN)
    assert HELD_OUT[0].prompt == sorted(HELD_OUT, key=all_scenes().index)[0].prompt


def test_tally_counts_each_attribute_the_pictures_show():
    red = Scene("circle", "red", "white", "center")
    blue_square = Scene("square", "blue", "white", "center")
    # the red circle's picture for both: the second reads back all but colour and shape
    assert tally([red, blue_square], [render(red), render(red)]) == {
        "colour": 1, "shape": 1, "position": 2, "background": 2}
