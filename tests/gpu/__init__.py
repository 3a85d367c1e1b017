"""GPU-only tests: run only where CUDA exists (a package, so that its conftest is not imported as the
module ``conftest`` that tests/conftest.py is to the other tests)."""
