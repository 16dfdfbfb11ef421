"""The compiled kernels' Python side: building them (kernel_build), loading them (kernel_library), and the
torch ops, packing and NumPy references over them (tree_attention, q4_linear, q8_linear)."""
