"""The model adapters (``base.py``; one module per family, the tiny builders) and their loader (``loading.py``).
Importing the package imports nothing heavy: the `model:` section (``config.py``) is read where torch is not
installed (the components image)."""
