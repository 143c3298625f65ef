"""The video demo world: its classifier reads rendered clips back exactly
(plain and with the training jitter), refuses a clip without a shape and
tells the directions apart; the prompt grammar and the held-out split are
fixed (the held-out combinations never appear among the training ones)."""

from __future__ import annotations

import numpy as np

from diffrt.demo.motion import (
    DIRECTIONS,
    EVALUATION,
    FRAMES,
    HELD_OUT,
    TRAIN,
    Clip,
    Variation,
    all_clips,
    classify,
    random_render,
    render,
    score,
    tally,
)
from diffrt.demo.shapes import PALETTE


def test_rendered_clips_are_read_back_as_their_prompts_say():
    """A spread of a sixth of the 1008 combinations (every attribute value
    appears), plain and jittered; the whole world reads back too (3024 of
    3024 clips when this was written), but at 25 ms a clip that is 75 s."""
    rng = np.random.default_rng(0)
    clips = all_clips()[::6]
    assert {c.direction for c in clips} == set(DIRECTIONS)
    for clip in clips:
        for video in (render(clip), random_render(clip, rng)):
            assert video.shape == (FRAMES, 64, 64, 3)
            assert all(score(clip, classify(video)).values()), clip.prompt


def test_the_jitter_extremes_are_read_back():
    rng = np.random.default_rng(1)
    for clip in rng.choice(np.array(all_clips(), dtype=object), 12):
        for v in (Variation(8, 3, 0.8, 0.85), Variation(-8, -3, 1.0, 1.15)):
            assert all(score(clip, classify(render(clip, v))).values()), (clip.prompt, v)


def test_a_clip_without_a_shape_has_none():
    video = np.broadcast_to(np.array(PALETTE["gray"], np.uint8), (FRAMES, 64, 64, 3))
    reading = classify(video)
    assert reading.background == "gray" and reading.colour is None and reading.direction is None


def test_a_reversed_clip_reads_as_the_opposite_motion():
    opposite = {"left to right": "right to left", "top to bottom": "bottom to top",
                "growing": "shrinking", "standing still": "standing still"}
    for forward, backward in opposite.items():
        clip = Clip("square", "blue", "white", forward)
        assert classify(render(clip)[::-1]).direction == backward


def test_the_prompt_grammar():
    assert Clip("circle", "red", "yellow", "left to right").prompt == (
        "a red circle moving left to right on a yellow background")
    assert Clip("square", "blue", "white", "growing").prompt == (
        "a blue square growing on a white background")
    assert Clip("triangle", "green", "black", "standing still").prompt == (
        "a green triangle standing still on a black background")


def test_the_held_out_split_is_fixed_and_never_trained_on():
    assert len(all_clips()) == 1008 and len(HELD_OUT) == 117 and len(TRAIN) == 891
    assert not set(HELD_OUT) & set(TRAIN)
    assert len(EVALUATION) == 30 and set(EVALUATION) <= set(HELD_OUT)
    # the evaluation asks for every direction, shape and colour
    for name in ("direction", "shape", "colour"):
        assert len({getattr(c, name) for c in EVALUATION}) == len({getattr(c, name)
                                                                   for c in all_clips()})
    assert EVALUATION[0].prompt == "a red circle growing on a white background"


def test_tally_counts_each_attribute_the_clips_show():
    red = Clip("circle", "red", "white", "left to right")
    blue = Clip("square", "blue", "white", "right to left")
    assert tally([red, blue], [render(red), render(red)]) == {
        "direction": 1, "colour": 1, "background": 2, "shape": 1}
