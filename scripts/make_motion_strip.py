"""The README's picture of diffrt-motion: a few prompts, each clip's frames in
a row (first to last), one PNG.

    .venv/bin/python scripts/make_motion_strip.py docs/images/diffrt-motion.png
"""

from __future__ import annotations

import sys

from PIL import Image, ImageDraw

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams

PROMPTS = [
    "a red circle moving left to right on a yellow background",  # scripts/demo.sh's
    "a blue square growing on a white background",
    "a green triangle moving top to bottom on a black background",
    "a purple circle moving right to left on a gray background",
]
CELL, CAPTION, FRAMES = 96, 20, 9


def main(path: str) -> int:
    with DiffusionEngine.make_engine(EngineConfig(model="diffrt-motion", executor_backend="inproc",
                                                  max_num_seqs=len(PROMPTS))) as engine:
        outs = engine.generate([DiffusionRequest(p, sampling_params=SamplingParams(seed=0))
                                for p in PROMPTS])
    strip = Image.new("RGB", (CELL * FRAMES, (CELL + CAPTION) * len(PROMPTS)), "white")
    draw = ImageDraw.Draw(strip)
    for row, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        assert out.ok and out.frames, out.error
        y = row * (CELL + CAPTION)
        draw.text((6, y + 4), prompt, fill="black")
        for k, frame in enumerate(out.frames[0]):
            strip.paste(frame.resize((CELL - 6, CELL - 6), Image.NEAREST),
                        (k * CELL + 3, y + CAPTION + 3))
    strip.save(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/images/diffrt-motion.png"))
