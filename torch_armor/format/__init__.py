"""The ARMOR file format: how a converted model is saved, checked and loaded (safetensors, the Hugging Face checkpoint, transformers' quantizer)."""
