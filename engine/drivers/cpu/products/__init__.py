"""The CPU driver's weight products behind one interface: each way of running a product a
class of its own (path.py), a product per matrix choosing among its paths by token count
(product.py), the choice measured once when the driver prepares (choice.py), and a prepared
model's products by weight name (model_products.py).

    int8        integer dot products on the codes, AVX-512 VNNI        integer.py
    avx2        the same sums on AVX2 (vpmaddwd), the same bits        integer.py
    blocks      the codes widened to float32, one block at a time      float_block.py
    mkl         MKL's packed GEMM on float32 values                    mkl.py
    openblas    NumPy's BLAS on float32 values                         blas.py
    few_tokens  a float32 matrix's products of 1 to 12 tokens          few_tokens.py

Every path on block codes takes the same input, the activations quantized to 16 bits per
block of 32 (quantized.py); registry.py says which paths a matrix may take.
"""

from .model_products import ModelProducts
from .product import Product, coded_product, float_product

__all__ = ["ModelProducts", "Product", "coded_product", "float_product"]
