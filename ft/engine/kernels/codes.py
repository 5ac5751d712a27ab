"""Values that host code writes into device tables and the kernels read back; torch-free, so
the host side imports them without Triton."""

# hybrid on device gates: a slot table entry the CPU computes in this step, and the gate's value
# once the host has written the CPU's share of the layer (ft.engine.strategies.hybrid)
ON_CPU, CPU_SHARE = -2, 2
