"""The README's picture of diffrt-shapes: a few prompts, their images, one PNG.

    .venv/bin/python scripts/make_demo_grid.py docs/images/diffrt-shapes.png
"""

from __future__ import annotations

import sys

from PIL import Image, ImageDraw

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

PROMPTS = [
    "a red circle on a yellow background in the top left",
    "a blue square on a white background in the center",
    "a green triangle on a black background in the bottom right",
    "a purple circle on a gray background in the middle right",
    "a yellow triangle on a blue background in the top middle",
    "a orange square on a green background in the bottom left",
]
CELL, CAPTION = 192, 34


def main(path: str) -> int:
    with DiffusionEngine.make_engine(EngineConfig(model="diffrt-shapes", executor_backend="inproc",
                                                  max_num_seqs=len(PROMPTS))) as engine:
        outs = engine.generate([DiffusionRequest(p,
                                                 sampling_params=SamplingParams(seed=0))
                                for p in PROMPTS])
    grid = Image.new("RGB", (CELL * 3, (CELL + CAPTION) * 2), "white")
    draw = ImageDraw.Draw(grid)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        x, y = (i % 3) * CELL, (i // 3) * (CELL + CAPTION)
        grid.paste(out.images[0].resize((CELL - 16, CELL - 16), Image.NEAREST), (x + 8, y + 8))
        words = prompt.split(" background")
        draw.text((x + 8, y + CELL - 4), words[0] + " background", fill="black")
        draw.text((x + 8, y + CELL + 12), words[1].strip(), fill="black")
    grid.save(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/images/diffrt-shapes.png"))
