"""ArmorTensor and its storages; the ARMOR checkpoint format (layout, flatten, safetensors_io,
serialization, hf_format)."""

# ArmorTensor's handlers for requires_grad_, copy_ and torch.load's safe globals live in interop,
# which imports armor_tensor: registered here, once, whatever module of the package is imported first.
from torch_armor.tensor import interop  # noqa: F401
