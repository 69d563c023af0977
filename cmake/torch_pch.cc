// The object that carries fmoe_torch_pch's precompiled LibTorch headers (cmake/torch_pch.cmake).
