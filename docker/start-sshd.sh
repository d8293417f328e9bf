#!/usr/bin/env bash
# Run an sshd as the (non-root) image user, so that DeepSpeed's pdsh launcher on the first node
# can start ranks in this container. Host keys are generated per container on first start.
#   SSH_PORT         port to listen on (default 2222, the port the image's ssh client uses)
#   AUTHORIZED_KEYS  file with the public keys allowed to log in (default ~/.ssh/authorized_keys;
#                    mount it, e.g. -v ~/.ssh/id_ed25519.pub:/home/moetrain/.ssh/authorized_keys:ro)
set -euo pipefail
SSH_PORT=${SSH_PORT:-2222}
AUTHORIZED_KEYS=${AUTHORIZED_KEYS:-$HOME/.ssh/authorized_keys}
keydir=$HOME/.ssh/sshd
mkdir -p "$keydir"
chmod 700 "$HOME/.ssh" "$keydir"
if [ ! -f "$keydir/ssh_host_ed25519_key" ]; then
  ssh-keygen -q -t ed25519 -N '' -f "$keydir/ssh_host_ed25519_key"
fi
if [ ! -s "$AUTHORIZED_KEYS" ]; then
  echo "start-sshd.sh: no public keys in $AUTHORIZED_KEYS; nobody will be able to log in" >&2
fi
exec /usr/sbin/sshd -D -e -p "$SSH_PORT" -h "$keydir/ssh_host_ed25519_key" \
  -o PidFile="$keydir/sshd.pid" -o UsePAM=no -o PasswordAuthentication=no \
  -o KbdInteractiveAuthentication=no -o AuthorizedKeysFile="$AUTHORIZED_KEYS" \
  -o StrictModes=no -o PermitUserEnvironment=no
