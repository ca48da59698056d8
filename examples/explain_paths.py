"""Which path each part of a stage takes: a compiled body and an eager head.

Run: python examples/explain_paths.py
"""
import torch, fxsplit
class Body(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
class Stage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Body()                       # compiled in place below
        self.head = torch.nn.Linear(8, 4)        # stays eager
    def forward(self, x):
        return self.head(self.body(x))
torch.manual_seed(0)
model = Stage()
model.body.compile(backend="fxsplit")
x = torch.randn(2, 8, requires_grad=True)
out = model(x)
dinputs, work = fxsplit.stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
print(fxsplit.explain(work))
fxsplit.stage_backward_weight(model.parameters(), work)
