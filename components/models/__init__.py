"""The model adapters (``base.py``; one folder per family with its adapters and tiny twins, registered in
``families.py``) and their loader (``loading.py``). Importing the package imports nothing heavy: the `model:` section
(``config.py``) and the family registry are read where torch is not installed (the components image)."""
