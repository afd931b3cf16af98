"""drvtrain's CUDA C++ kernel sources (``*.cu``, ``*.cuh``), shipped as package data."""
