from cloud_hub.client.globus_compute import Executor

ep_id = "<ENDPOINT_ID>"  # guide fix: the guide's snippet takes ep_id from the previous example

def generate_collatz_sequence(N: int, sequence_limit=100):
    seq = [N]
    while N != 1 and len(seq) < sequence_limit:
        if N % 2:
            N = 3 * N + 1
        else:
            N //= 2  # okay because guaranteed integer result
        seq.append(N)
    if N != 1:
        raise ValueError(f"Sequence not terminated in {sequence_limit} steps")
    return seq

with Executor(endpoint_id=ep_id) as gce:
    future = gce.submit(generate_collatz_sequence, 1234567890)

try:
    print(future.result())
except Exception as exc:
    print(f"Oh no!  The task raised an exception: {exc}")  # guide fix: its closing quote is missing
