from .context_query import ContextQuery
from .hybrid_attention import HybridMultiheadAttention
from .local_conv import LocalConv
from .tag_heads import TagHeads

__all__ = ["ContextQuery", "HybridMultiheadAttention", "LocalConv", "TagHeads"]
