import numpy as np
from drvtrain import DeviceBuffer, Stream
from drvtrain.nn import ParamLayout, MLP
from drvtrain.nn.mlp import gemm
s = Stream(); rng = np.random.default_rng(0)
mlp = MLP(ParamLayout([(1024, 1024)]))
for (m, n, k) in ((256, 3, 256), (512, 1024, 1024)):
    a = DeviceBuffer.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    w = DeviceBuffer.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
    b = DeviceBuffer.from_numpy(np.zeros(n, np.float32)); y = DeviceBuffer((m, n))
    for _ in range(3):
        gemm(mlp.hidden_kernel, a, k, w, k, y, n, m, n, k, s, bias=b)
    s.synchronize()
