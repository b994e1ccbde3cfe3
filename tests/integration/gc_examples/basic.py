from cloud_hub.client.globus_compute import Executor

def double(x):
    return x * 2

tutorial_endpoint_id = '<ENDPOINT_ID>'
with Executor(endpoint_id=tutorial_endpoint_id) as gce:
    fut = gce.submit(double, 7)

    print(fut.result())
