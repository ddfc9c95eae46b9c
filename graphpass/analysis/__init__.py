"""Read-only understanding of a captured graph: which ops are row-local (`rowlocal`), the regions
they form (`regions`), where gradients flow (`grad_flow`), and what each region computes (`recognize`)."""
