"""Where a model's weights live and in what precision: lower-precision
weights (``quantize``) and the bytes they hold (``resident``)."""
