import time, torch
import flatflower.strategies.registry  # noqa: F401
from flatflower.common.config import RunConfig
from flatflower.common.data import dataset_for
from flatflower.common.evaluate import evaluate
from flatflower.common.models import build_model
cfg = RunConfig.from_mapping({"dataset": "fashion-mnist", "model": "lenet5"})
data = dataset_for(cfg)
for threads in (1, 16):
    torch.set_num_threads(threads)
    model = build_model("lenet5", data.input_shape, data.num_classes, seed=0)
    evaluate(model, data.test); t = time.perf_counter(); r = evaluate(model, data.test); 
    print(f"server evaluate, 10000 test images, cpu {threads} thread(s): {time.perf_counter()-t:.3f}s", r, flush=True)
if torch.cuda.is_available():
    m = build_model("lenet5", data.input_shape, data.num_classes, seed=0).cuda()
    evaluate(m, data.test); torch.cuda.synchronize(); t = time.perf_counter(); r2 = evaluate(m, data.test); torch.cuda.synchronize()
    print(f"evaluate on cuda: {time.perf_counter()-t:.3f}s", r2, flush=True)
