"""``diffrt generate --image/--mask/--strength``: an inpainting run of the
demo model in this process (the in-process executor), and the refusals,
each one line with exit status 2 before any engine starts."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from test_cli_refusals import run_main

PROMPT = "a red circle on a yellow background in the center"


@pytest.fixture
def inputs(tmp_path):
    picture = Image.new("RGB", (64, 64), (250, 220, 0))
    picture.paste((0, 0, 200), (0, 0, 12, 12))  # a blue corner, to see it kept
    picture.save(tmp_path / "in.png")
    alpha = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    alpha.paste((0, 0, 0, 0), (16, 16, 48, 48))  # OpenAI's mask: edit the transparent middle
    alpha.save(tmp_path / "alpha.png")
    Image.new("L", (32, 32), 255).save(tmp_path / "small.png")
    (tmp_path / "notes.txt").write_text("not a picture")
    return tmp_path


def test_an_inpainting_run_keeps_the_picture_outside_the_mask(inputs, monkeypatch):
    monkeypatch.chdir(inputs)
    code, err = run_main("generate", "-p", PROMPT, "--image", "in.png", "--mask", "alpha.png",
                         "--strength", "0.9", "--seed", "1", "-o", "edit.png", "--no-progress",
                         "--executor-backend", "inproc", "--no-warmup")
    assert code == 0, err
    out = np.asarray(Image.open(inputs / "edit.png").convert("RGB"), dtype=np.int16)
    picture = np.asarray(Image.open(inputs / "in.png"), dtype=np.int16)
    assert out.shape == (64, 64, 3)
    outside = np.ones((64, 64), dtype=bool)
    outside[16:48, 16:48] = False  # transparent in the mask: repainted
    np.testing.assert_array_equal(out[outside], picture[outside])  # kept, the blue corner too
    assert np.abs(out[~outside] - picture[~outside]).max() > 30  # the middle was redrawn


@pytest.mark.parametrize("args,needle", [
    (["--mask", "alpha.png"], "--mask needs an --image to mask"),
    (["--strength", "0.5"], "strength: applies to an input image"),
    (["--image", "notes.txt"], "--image 'notes.txt': is not an image file"),
    (["--image", "missing.png"], "cannot read --image 'missing.png'"),
    (["--image", "in.png", "--mask", "small.png"],
     "--mask: is 32x32, the image it masks 64x64: they must be the same size"),
    (["--image", "in.png", "--image", "in.png"], "--image: diffrt-shapes takes at most 1"),
    (["--image", "in.png", "--strength", "1.5"], "strength: must be a number <= 1.0, got 1.5"),
])
def test_bad_inputs_are_refused_in_one_line(inputs, monkeypatch, args, needle):
    monkeypatch.chdir(inputs)
    code, err = run_main("generate", "-p", PROMPT, *args, "--executor-backend", "inproc")
    assert code == 2, err
    assert needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
