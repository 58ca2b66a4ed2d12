# An IAM user for the cloud tests and recordings, made in moto before it checks
# signatures (moto_server's INITIAL_NO_AUTH_ACTION_COUNT=3: these three
# requests). Prints "KEY-ID SECRET". Usage: python moto-iam-setup.py ENDPOINT USER
import sys

import boto3

iam = boto3.client("iam", endpoint_url=sys.argv[1], region_name="us-east-1",
                   aws_access_key_id="setup", aws_secret_access_key="setup")
iam.create_user(UserName=sys.argv[2])
key = iam.create_access_key(UserName=sys.argv[2])["AccessKey"]
iam.put_user_policy(UserName=sys.argv[2], PolicyName="all",
    PolicyDocument='{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]}')
print(key["AccessKeyId"], key["SecretAccessKey"])
