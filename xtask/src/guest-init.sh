#!/bin/sh
# PID 1 of the `cargo xtask rxe` guest: busybox sh in the initramfs built by
# xtask/src/rxe/initramfs.rs. What must be known before the control share is
# mounted comes on the kernel command line (the kernel hands unknown
# key=value parameters to init as environment variables):
#   rxevm_rxe=0|1  rxevm_netdev=dummy|lo|link  rxevm_trace=0|1
#   rxevm_addr=ADDR/PREFIX  rxevm_name=NAME   (netdev link: the two-guest mode)
# The rest lives on the control share: `shares` (sourced) and `cmd` (run).
# Under TCG every process costs tens of milliseconds, so builtins are
# preferred and slow steps run in the background.

export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

trace() {
	if [ "$rxevm_trace" = 1 ]; then
		read -r up _ </proc/uptime
		echo "rxe-init ${up}s: $*"
	fi
}

# The host turns /mnt/ctl/error into exit status 125 plus this message.
fail() {
	echo "rxe-init: error: $*"
	echo "$*" >/mnt/ctl/error
	poweroff -f
}

trace start
if [ "$rxevm_rxe" = 1 ]; then
	# crc32_generic: rxe asks the crypto API for crc32 and qemu64 has no
	# PCLMUL. dummy (numdummies defaults to 1) creates dummy0 by itself.
	extra=
	[ "$rxevm_netdev" = dummy ] && extra=dummy
	# The two-guest mode's link to the other guest is a virtio NIC.
	[ "$rxevm_netdev" = link ] && extra=virtio_net
	modprobe -a crc32_generic rdma_rxe ib_uverbs rdma_ucm ib_umad $extra &
	rdma_modules=$!
fi
modprobe -a virtio_pci virtio_console 9pnet_virtio 9p overlay || fail "cannot load the virtio/9p modules"

p9=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o $p9,cache=none rxectl /mnt/ctl || fail "cannot mount the control share"
# The host's / is the guest's root: read-only 9p under a throw-away tmpfs.
mount -t 9p -o $p9,ro,cache=loose hostroot /mnt/host || fail "cannot mount the host root"
mount -t tmpfs -o mode=0755 tmpfs /mnt/rw
mkdir /mnt/rw/upper /mnt/rw/work
R=/newroot
mount -t overlay -o lowerdir=/mnt/host,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work overlay $R ||
	fail "cannot mount the overlay root"
trace "root mounted"

ip link set lo up
if [ "$rxevm_rxe" = 1 ]; then
	wait $rdma_modules || fail "cannot load the RDMA modules"
	trace "rdma modules loaded"
	dev=lo
	if [ "$rxevm_netdev" = dummy ]; then
		# dummy0 exists only in this guest, which has no NIC: nothing sent
		# to 192.0.2.1 (TEST-NET-1) can leave it. MTU 9000 gives active_mtu 4096.
		dev=dummy0
		ip link set dev $dev address 02:00:00:00:00:01 mtu 9000 up || fail "cannot configure $dev"
		ip addr add 192.0.2.1/24 dev $dev || fail "cannot address $dev"
	elif [ "$rxevm_netdev" = link ]; then
		# The only NIC: a virtio link to the other guest of `--two-guests`
		# (its MAC is set by QEMU, so each guest has its own). Standard MTU:
		# rxe's active_mtu is 1024 here, as on a plain Ethernet.
		dev=eth0
		ip link set dev $dev up || fail "cannot bring up $dev"
		ip addr add $rxevm_addr dev $dev || fail "cannot address $dev"
	fi
	# busybox has no `rdma`: use the host's iproute2, in the background
	# while the rest of the root is mounted.
	chroot $R rdma link add rxe0 type rxe netdev $dev >/tmp/rdma.log 2>&1 &
	rdma_link=$!
fi

mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm
# What udev would add: bash's process substitution needs /dev/fd.
ln -s /proc/self/fd $R/dev/fd
for i in 0:stdin 1:stdout 2:stderr; do ln -s /proc/self/fd/${i%%:*} $R/dev/${i#*:}; done
mount -t devpts -o newinstance,ptmxmode=0666 devpts $R/dev/pts
for d in dev/shm tmp; do mount -t tmpfs -o mode=1777 tmpfs $R/$d; done
mount -t tmpfs -o mode=0755 tmpfs $R/run
mkdir $R/run/rxe-vm
mount --bind /mnt/ctl $R/run/rxe-vm

# `shares` calls this once per host directory shared read-write.
share() {
	mkdir -p "$R$2" && mount -t 9p -o $p9,cache=mmap "$1" "$R$2" || fail "cannot mount share $2"
}
. /mnt/ctl/shares
host=rxe-vm${rxevm_name:+-$rxevm_name}
hostname $host
echo "127.0.1.1 $host" >>$R/etc/hosts
trace "shares mounted"

if [ "$rxevm_rxe" = 1 ]; then
	wait $rdma_link || { cat /tmp/rdma.log; fail "rdma link add rxe0 netdev $dev failed"; }
	trace "rxe0 on $dev"
fi

out=/dev/console
err=/dev/console
for port in /sys/class/virtio-ports/*; do
	read -r name <"$port/name"
	case $name in
	stdout) out=/dev/${port##*/} ;;
	stderr) err=/dev/${port##*/} ;;
	esac
done

ulimit -l unlimited
trace "running the command"
# Always on the console: the host's boot watchdog waits for this line.
echo "rxe-init: command started"
env -i chroot $R /bin/sh /run/rxe-vm/cmd </dev/null >"$out" 2>"$err"
echo $? >/mnt/ctl/status
trace "command done"
poweroff -f
