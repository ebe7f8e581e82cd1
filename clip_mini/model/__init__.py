"""The dual encoder: image and text towers, projection heads, the contrastive loss, pretrained-weight readers,
attention maps and the ONNX export of the towers. Tower-specific layer tricks live in ``layers``."""
