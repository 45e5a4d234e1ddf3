"""The Triton model repository template (helios/config.pbtxt, helios/1/model.py), a package
so that a plain `pip install` ships it; the launcher copies it, never imports it."""
