"""Point-to-point transfer of stage boundaries between ranks.

``transport.py`` sends and receives a micro-batch boundary with split-concat (DAPPLE 5.2.2),
its messages named by ``keys.py``; ``wires.py`` decides once per run how tensors travel (gloo,
pinned host staging for CUDA tensors over gloo, or NCCL), ``links.py`` holds the NCCL
communicator of each link and direction, and ``staging.py`` the pinned host buffers.
"""
