"""The README's picture of edits on diffrt-shapes: one input image redrawn
at two strengths, and a plain picture inpainted in one cell, one PNG.

    .venv/bin/python scripts/make_edit_example.py docs/images/edit-example.png
"""

from __future__ import annotations

import sys

import numpy as np
from PIL import Image, ImageDraw

from diffrt.demo.shapes import Scene, render
from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

CELL, CAPTION = 192, 34
MOVED = "a blue circle on a yellow background in the bottom right"
SQUARE = "a green square on a gray background in the bottom right"


def main(path: str) -> int:
    source = render(Scene("circle", "red", "yellow", "top left"))
    plain = Image.new("RGB", source.size, (128, 128, 128))
    mask = np.zeros((64, 64), np.uint8)
    mask[43:, 43:] = 255  # the bottom-right cell
    requests = [DiffusionRequest(MOVED, images=[source], sampling_params=SamplingParams(
                    seed=1, strength=strength)) for strength in (0.3, 1.0)]
    requests.append(DiffusionRequest(SQUARE, images=[plain], mask_image=Image.fromarray(mask),
                                     sampling_params=SamplingParams(seed=0, strength=1.0)))
    with DiffusionEngine.make_engine(EngineConfig(model="diffrt-shapes", executor_backend="inproc",
                                                  step_execution=True, max_num_seqs=3)) as engine:
        outs = engine.generate(requests)
    cells = [(source, "input"), (outs[0].images[0], "strength 0.3"),
             (outs[1].images[0], "strength 1.0"),
             (Image.composite(Image.new("RGB", plain.size, "white"), plain,
                              Image.fromarray(mask)), "input + mask"),
             (outs[2].images[0], "inpainted")]
    grid = Image.new("RGB", (CELL * len(cells), CELL + CAPTION), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, caption) in enumerate(cells):
        grid.paste(image.resize((CELL - 16, CELL - 16), Image.NEAREST), (i * CELL + 8, 8))
        draw.text((i * CELL + 8, CELL - 4), caption, fill="black")
    draw.text((8, CELL + 14), f"cells 2-3: \"{MOVED}\"; cell 5: \"{SQUARE}\"", fill="black")
    grid.save(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/images/edit-example.png"))
