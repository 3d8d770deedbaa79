"""ARMOR weights as tensors: one class per core storage format, the storage policy, save and load.

Importing the package registers every format (dense, compact, semi-structured, quantized) and the
plain-PyTorch interop handlers, so any ArmorTensor found anywhere can be moved, copied and loaded.
``interop`` and ``experts`` are imported right after ``armor_tensor``: they fill ``ArmorTensor``'s op
tables, which each storage class copies when its module defines it (torchao's
``TorchAOBaseTensor.__init_subclass__``).
"""

from torch_armor.tensor import armor_tensor, interop, experts  # noqa: F401  (before any storage class: see above)
from torch_armor.tensor import formats, quant, semi_structured  # noqa: F401
