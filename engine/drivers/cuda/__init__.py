"""The CUDA driver's kernels (CUDA C++, compiled with NVRTC to sm_90 cubin), their NumPy
references and the compile step shared by the driver and the CI compile checks."""
