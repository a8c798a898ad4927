"""Small compiled CPU kernels of our own, built at install time (``engine.kernels.build``) and
called through ctypes; every caller keeps a PyTorch path for where no build loads."""
