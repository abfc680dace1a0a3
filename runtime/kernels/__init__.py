"""Compiled CPU kernels (``csrc/``) shared by attention and the dense layers; built at first use."""
