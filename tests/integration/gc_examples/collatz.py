from cloud_hub.client.globus_compute import Executor

def generate_collatz_sequence(N: int, sequence_limit = 10_000):
    seq = [N]
    while N != 1 and len(seq) < sequence_limit:
        if N % 2:
            N = 3 * N + 1
        else:
            N //= 2  # okay because guaranteed integer result
        seq.append(N)
    return seq

ep_id = "<ENDPOINT_ID>"

generate_from = 1
generate_through = 100
futs, results, disproof_candidates = [], [], []
with Executor(endpoint_id=ep_id) as gce:
    for n in range(generate_from, generate_through + 1):
        futs.append(gce.submit(generate_collatz_sequence, n))
    print("Tasks all submitted; waiting for results")

# The futures were appended to the `futs` list in order, so one could wait
# for each result in turn to get a submission-ordered set of results:
for f in futs:
    r = f.result()
    results.append(r)
    if r[-1] != 1:
        # of course, given the conjecture, we don't expect this branch
        disproof_candidates.append(r[0])

print(f"All sequences generated (from {generate_from} to {generate_through})")
for res in results:
    print(res)

if disproof_candidates:
    print("Possible conjecture disproving integers:", disproof_candidates)
