"""Flash attention for the NKI backend: not written yet (this commit carries Adam and the norm)."""


def attention_supports(call):
    return ["NKI attention kernels are not written yet"]


def attention_fwd(**call):
    raise NotImplementedError("NKI attention forward is not written yet")


def attention_bwd(**call):
    raise NotImplementedError("NKI attention backward is not written yet")
