"""Small layer-level tricks used by one tower or one pass: fused conv+activation, BatchNorm folding, dropout
variants, kernels and the compile pass."""
