"""Write a small image folder in torchvision's ImageFolder layout, offline:

    OUT/train/<class>/*.png
    OUT/test/<class>/*.png

from scikit-learn's bundled 8x8 digits, each image scaled up to 32x32 RGB. Stand-in for your own
photos: point ``data-dir`` at a folder of the same layout. Usage: python make_folder.py OUT [--per-class N]
"""

import argparse
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--per-class", type=int, default=60, help="images per class (train + test)")
    args = parser.parse_args(argv)
    digits = load_digits()
    rng = np.random.default_rng(0)
    for label in range(10):
        rows = rng.permutation(np.flatnonzero(digits.target == label))[: args.per_class]
        cut = int(0.8 * len(rows))
        for split, chosen in (("train", rows[:cut]), ("test", rows[cut:])):
            folder = Path(args.out) / split / f"digit-{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                grey = (digits.images[i] * 255 / 16).astype(np.uint8)
                Image.fromarray(grey).convert("RGB").resize((32, 32), Image.NEAREST).save(folder / f"{i}.png")
    print(f"wrote {args.out}/train and {args.out}/test (10 classes)")


if __name__ == "__main__":
    main()
