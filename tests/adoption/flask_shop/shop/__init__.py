# empty: shop is a package (Flask("shop") finds its root path from it)
