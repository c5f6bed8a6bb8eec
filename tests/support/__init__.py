"""What the tests share: paths, NumPy references, the kernel test base, a served subprocess, small problems."""
