#!/bin/busybox sh
# PID 1 of the test guest (packed into the initramfs by run.sh): mount the
# host root read-only over virtio-fs under a tmpfs overlay, load bunshin.ko,
# run guest-tests.sh in a chroot, unload, and leave rc, output.log and
# dmesg.txt in the results share.  rc 126: insmod/rmmod failed or the kernel
# logged a BUG/WARNING/Oops.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t devtmpfs dev /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sys /sys
for m in $(cat /modules.order); do insmod /lib/modules/$m.ko || echo "GUEST: insmod $m failed"; done

fail() { echo "GUEST: $*"; poweroff -f; }
mkdir -p /lower /rw /host /results
mount -t virtiofs results /results || fail "mount results"
R=/results
. $R/guest.env
mount -t virtiofs -o ro hostroot /lower || fail "mount hostroot"
mount -t tmpfs -o mode=755 rw /rw && mkdir /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /host \
  || fail "overlay"
mount -t tmpfs -o mode=755 run /host/run || fail "tmpfs /run"
mkdir -p /host/run/results /host/run/tmp /host/run/home
chmod 1777 /host/run/tmp
mount --bind /results /host/run/results
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t debugfs debugfs /host/sys/kernel/debug
mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs shm /host/dev/shm

# Processes left once the tests return: anything but us, the log tail and
# kernel threads (which have no exe link).
strays() {
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = 1 ] || [ "$p" = "$tailpid" ] || [ ! -e $d/exe ] || echo $p
  done
}

st=0
if insmod /host$KO; then
  # output goes to a file rather than a pipe, so a process that outlives
  # the tests cannot hold the run open.  The tests get a mount namespace
  # whose / is the host tree moved over the initramfs, as after switch_root
  # on a booted system: a plain chroot would leave the initramfs as the
  # namespace root, where workspaces cannot pivot_root and /proc/PID/fd
  # links of their files read /host/...
  unshare -m sh -c 'cd /host && mount --move . / && exec chroot . "$@"' guest-tests \
      /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/run/home \
      TMPDIR=/run/tmp RESULTS_DIR=/run/results LANG=C.UTF-8 TERM=dumb \
      PYTHONDONTWRITEBYTECODE=1 BUNSHIN_GUEST_PYTHON="$PY" BUNSHIN_HOST="$HOSTINFO" \
      /bin/bash "$TESTS/guest-tests.sh" > $R/output.log 2>&1 < /dev/null &
  cmd=$!
  tail -f $R/output.log &
  tailpid=$!
  wait $cmd
  st=$?
  sleep 1
  kill $tailpid
  strays > /strays   # not $(strays): that subshell would list itself
  left=$(cat /strays)
  if [ -n "$left" ]; then
    echo "GUEST: processes outlived the tests:"
    for p in $left; do
      echo "  $p $(tr '\0' ' ' < /proc/$p/cmdline) [$(grep State /proc/$p/status)]"
      sed 's/^/    /' /proc/$p/stack
    done
    kill -9 $left
    [ $st = 0 ] && st=1
  fi
  rmmod bunshin || { echo "GUEST: rmmod bunshin failed"; [ $st = 0 ] && st=126; }
  if [ -e /host/dev/bunshin ] || [ -e /host/sys/kernel/debug/bunshin ]; then
    echo "GUEST: /dev/bunshin or its debugfs dir outlived rmmod"; [ $st = 0 ] && st=126
  fi
else
  echo "GUEST: insmod $KO failed"; st=126
fi
dmesg > $R/dmesg.txt
if grep -qE 'BUG:|Oops|WARNING:|general protection|Call Trace' $R/dmesg.txt; then
  echo "GUEST: kernel log has BUG/WARNING/Oops"; [ $st = 0 ] && st=126
fi
echo $st > $R/rc
sync
umount /host/run/results
umount $R
poweroff -f
