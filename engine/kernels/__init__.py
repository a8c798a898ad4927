"""Small compiled kernels of our own, built on first use with the machine's C compiler
(``engine.kernels.build``) and called through ctypes; every caller keeps a PyTorch path for
where no compiler exists or a build fails."""
