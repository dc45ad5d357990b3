"""The torch.library namespace of fa_backend's custom ops."""

NAMESPACE = "fa_backend"
