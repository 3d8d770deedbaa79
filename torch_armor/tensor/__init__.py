"""ARMOR weights as tensors: one class per core storage format, the storage policy, save and load.

Importing the package registers every format (dense, compact, semi-structured, quantized) and the
plain-PyTorch interop handlers, so any ArmorTensor found anywhere can be moved, copied and loaded.
"""

from torch_armor.tensor import armor_tensor, experts, formats, interop, quant, semi_structured  # noqa: F401
