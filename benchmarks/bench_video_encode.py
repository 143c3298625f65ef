"""What encoding a clip costs (``engine/video_files.py``): seconds per clip
and per frame, file size, and PSNR of the decoded frames, for H.264
yuv420p at a few crf values, lossless RGB H.264, with and without sound.

Printed, never asserted. Run from the repository root:

    .venv/bin/python benchmarks/bench_video_encode.py                      # 9x64², 33x128², 81x480x832
    .venv/bin/python benchmarks/bench_video_encode.py --clips 81x480x832 --repeats 3

The frames are smooth random fields with fine noise on top (as a
random-weight decoder's frames look: ``tests/video_decode.smooth_noise``),
which compress far worse than natural video: the sizes and PSNR here are a
floor, the times close to what a real clip of that size costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from video_decode import decode_mp4, psnr, smooth_noise  # noqa: E402

from diffrt.engine.video_files import Waveform, encode_mp4  # noqa: E402


def _clip(text: str) -> tuple[int, int, int]:
    frames, height, width = (int(v) for v in text.split("x"))
    return frames, height, width


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", nargs="+", type=_clip,
                    default=[(9, 64, 64), (33, 128, 128), (81, 480, 832)],
                    help="FRAMESxHEIGHTxWIDTH each")
    ap.add_argument("--fps", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    settings = [("crf 18 (default)", {}), ("crf 23", {"crf": 23}),
                ("lossless", {"lossless": True}), ("crf 18 + AAC", {"audio": True})]
    encode_mp4(smooth_noise(0, frames=2, height=16, width=16), args.fps)  # FFmpeg's first start
    print(f"{'clip':>12} {'setting':>18} {'s/clip':>8} {'ms/frame':>9} {'bytes':>10} "
          f"{'raw x':>7} {'min PSNR':>9}")
    for frames, height, width in args.clips:
        pixels = smooth_noise(0, frames=frames, height=height, width=width)
        for name, options in settings:
            kwargs = dict(options)
            if kwargs.pop("audio", False):
                rate = 24000
                n = int(frames / args.fps * rate)
                kwargs["audio"] = Waveform(np.sin(np.arange(n) / rate * 2 * np.pi * 440) * 0.5,
                                           rate)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                data = encode_mp4(pixels, args.fps, **kwargs)
                times.append(time.perf_counter() - start)
            back = decode_mp4(data).frames
            low = min(psnr(a, b) for a, b in zip(back, pixels, strict=True))
            seconds = statistics.median(times)
            print(f"{frames}x{height}x{width:<4} {name:>18} {seconds:8.3f} "
                  f"{seconds / frames * 1000:9.2f} {len(data):10d} "
                  f"{len(data) / pixels.nbytes:7.3f} {low:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
