# A task config with no backend in it: the DeepSpeed script's flags choose the engine.
#   torchrun --nproc_per_node 2 -m distkit train configs/deepspeed_digits.py --deepspeed --deepspeed_config configs/ds_zero2.json
#   deepspeed --num_accelerators 2 --module distkit train configs/deepspeed_digits.py --deepspeed --deepspeed_config configs/ds_zero2.json
task = "digits"
num_epochs = 5
output_dir = "runs/deepspeed_digits"
