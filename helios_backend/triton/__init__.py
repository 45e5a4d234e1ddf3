"""Serving through Triton: the Python-backend adapter and the tritonserver launcher."""
