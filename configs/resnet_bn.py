# A small ResNet with BatchNorm (hand-written: a stem and 3 residual blocks, 9 BatchNorm layers,
# 10k parameters) on seeded synthetic 32x32 RGB images of 4 learnable classes; (inputs, targets)
# items, cross-entropy.
# BatchNorm's running statistics are model state that is not a parameter: grad mode gives every rank
# rank 0's (DDP semantics; also at the end), param mode averages them with the parameters, and
# summary.json's ranks_in_sync covers them.
#   distkit train configs/resnet_bn.py --nprocs 2                                   # DDP, grad mode
#   distkit train configs/resnet_bn.py --nprocs 2 ++distributed "{'backend': 'mpi', 'reduce_type': 'param', 'param_sync_step': 3}"
#   distkit train configs/resnet_bn.py --nprocs 2 ++use_horovod True
#   distkit train configs/resnet_bn.py --nprocs 2 ++distributed "{'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 2}}}"
import torch
from torch import nn

_CLASSES = 4


class _Block(nn.Module):
    """conv-BN-ReLU-conv-BN plus the shortcut (1x1 conv + BN when the shape changes), then ReLU."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class _ResNet(nn.Module):
    def __init__(self, width=8, classes=_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(_Block(width, width, 1), _Block(width, 2 * width, 2),
                                    _Block(2 * width, 2 * width, 2))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def model():
    return _ResNet()


def _images(n, seed):
    """Class k: a fixed random low-frequency 32x32x3 pattern (the same for every split) plus noise."""
    templates = nn.functional.interpolate(torch.randn(_CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(0)),
                                          size=32, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, _CLASSES, (n,), generator=g)
    x = templates[y] + 0.8 * torch.randn(n, 3, 32, 32, generator=g)
    return [(x[i], y[i]) for i in range(n)]


def dataset():
    return _images(256, seed=1), _images(64, seed=2)


metrics = ["accuracy"]
optimizer = {"class": "sgd", "momentum": 0.9}
learning_rate = 0.05
batch_size = 8           # per rank
max_steps = 20
log_every = 5
torch_distributed = {}   # DDP, grad mode; the command line may pick another engine
output_dir = "runs/resnet_bn"
