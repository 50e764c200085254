"""The training algorithms, one module each (`train.algorithm: <key>`); `base` is the seam they plug into."""
