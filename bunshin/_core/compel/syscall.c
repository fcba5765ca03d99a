/* Running system calls inside the stopped injection thread, and reading/writing its memory. */
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>

#include "internal.h"

#define LOG_PREFIX "syscall: "

int bx_peek(struct bx_ctl *c, unsigned long addr, void *buf, size_t n)
{
	struct iovec l = {buf, n}, r = {(void *)addr, n};
	ssize_t got = process_vm_readv(c->pid, &l, 1, &r, 1, 0);
	if (got == (ssize_t)n)
		return 0;
	return bx_fail(c, BX_STEP_PEEK, got < 0 ? -errno : -EFAULT);
}

int bx_poke(struct bx_ctl *c, unsigned long addr, const void *buf, size_t n)
{
	struct iovec l = {(void *)buf, n}, r = {(void *)addr, n};
	ssize_t put = process_vm_writev(c->pid, &l, 1, &r, 1, 0);
	if (put == (ssize_t)n)
		return 0;
	return bx_fail(c, BX_STEP_POKE, put < 0 ? -errno : -EFAULT);
}

/* Through ptrace, which writes read-only (text) mappings too: one word at a time. */
static int poke_text(pid_t tid, unsigned long addr, const void *buf, size_t n)
{
	const uint8_t *b = buf;
	for (size_t off = 0; off < n; off += sizeof(long)) {
		unsigned long at = addr + off;
		long word;
		errno = 0;
		word = ptrace(PTRACE_PEEKDATA, tid, at, 0);
		if (errno)
			return -errno;
		memcpy(&word, b + off, n - off < sizeof word ? n - off : sizeof word);
		if (ptrace(PTRACE_POKEDATA, tid, at, word))
			return -errno;
	}
	return 0;
}

int bx_patch_save(struct bx_ctl *c, unsigned long addr, size_t len, int text)
{
	if (c->npatch == BX_MAX_PATCH || len > BX_SCRATCH_SIZE)
		return -ENOSPC;
	struct bx_patch *p = &c->patch[c->npatch];
	int ret;
	if (text) {
		for (size_t off = 0; off < len; off += sizeof(long)) {
			errno = 0;
			long word = ptrace(PTRACE_PEEKDATA, c->thr[0].tid, addr + off, 0);
			if (errno)
				return -errno;
			memcpy(p->orig + off, &word, len - off < sizeof word ? len - off : sizeof word);
		}
	} else if ((ret = bx_peek(c, addr, p->orig, len))) {
		return ret;
	}
	p->addr = addr;
	p->len = len;
	p->text = text;
	c->npatch++;
	return 0;
}

int bx_patch_restore(struct bx_ctl *c)
{
	int ret = 0;
	for (int i = c->npatch - 1; i >= 0; i--) {
		struct bx_patch *p = &c->patch[i];
		int r = p->text ? poke_text(c->thr[0].tid, p->addr, p->orig, p->len)
				: bx_poke(c, p->addr, p->orig, p->len);
		if (r && !ret)
			ret = r;
	}
	c->npatch = 0;
	return ret;
}

/* Memory the tracee is not using: below its stack pointer and red zone, where the kernel would
 * put a signal frame. Saved first so cure can put the bytes back. */
int bx_scratch(struct bx_ctl *c, unsigned long *addr)
{
	if (!c->scratch) {
		unsigned long a = (bx_arch_sp(&c->thr[0].regs) - BX_ARCH_REDZONE - BX_SCRATCH_SIZE) &
				  ~63UL;
		int ret = bx_patch_save(c, a, BX_SCRATCH_SIZE, 0);
		if (ret)
			return ret;
		c->scratch = a;
	}
	*addr = c->scratch;
	return 0;
}

/* First two bytes of 0f 05 anywhere in an executable mapping, the vdso first: executing them
 * is all we need, we stop at syscall exit before the next instruction. */
static unsigned long find_syscall_insn(struct bx_ctl *c)
{
	char path[64], line[512];
	unsigned long found = 0;
	static uint8_t buf[1 << 16];
	snprintf(path, sizeof path, "/proc/%d/maps", c->pid);
	for (int pass = 0; pass < 2 && !found; pass++) {
		FILE *f = fopen(path, "re");
		if (!f)
			return 0;
		while (!found && fgets(line, sizeof line, f)) {
			unsigned long a, b;
			char perm[8];
			if (sscanf(line, "%lx-%lx %7s", &a, &b, perm) != 3 || perm[2] != 'x')
				continue;
			if ((strstr(line, "[vdso]") != NULL) != (pass == 0))
				continue;
			for (unsigned long at = a; at < b && !found; at += sizeof buf - 1) {
				size_t n = b - at < sizeof buf ? b - at : sizeof buf;
				struct iovec l = {buf, n}, r = {(void *)at, n};
				if (process_vm_readv(c->pid, &l, 1, &r, 1, 0) != (ssize_t)n)
					break;
				for (size_t i = 0; i + 1 < n; i++)
					if (!memcmp(buf + i, bx_arch_syscall_insn, BX_ARCH_SYSCALL_LEN)) {
						found = at + i;
						break;
					}
			}
		}
		fclose(f);
	}
	return found;
}

int bx_prepare_seized(struct bx_ctl *c)
{
	if (c->prepared)
		return 0;
	if (c->dead)
		return bx_fail(c, BX_STEP_PREPARE, -ESRCH);
	const bx_regs_t *r = &c->thr[0].regs;
	uint8_t ins[BX_ARCH_SYSCALL_LEN];
	struct iovec l = {ins, sizeof ins}, rv = {(void *)bx_arch_syscall_site(r), sizeof ins};
	if (bx_arch_in_syscall(r) && process_vm_readv(c->pid, &l, 1, &rv, 1, 0) == sizeof ins &&
	    !memcmp(ins, bx_arch_syscall_insn, sizeof ins)) {
		c->sysaddr = bx_arch_syscall_site(r);
	} else if (!(c->sysaddr = find_syscall_insn(c))) {
		/* last resort: write one at the stopped ip, cure writes the old bytes back */
		unsigned long at = bx_arch_ip(r);
		int ret = bx_patch_save(c, at, BX_ARCH_SYSCALL_LEN, 1);
		if (!ret)
			ret = poke_text(c->thr[0].tid, at, bx_arch_syscall_insn, BX_ARCH_SYSCALL_LEN);
		if (ret)
			return bx_fail(c, BX_STEP_PREPARE, ret);
		c->sysaddr = at;
	}
	c->prepared = 1;
	bx_log("%d: syscall instruction at %#lx", c->pid, c->sysaddr);
	return 0;
}

/* A fork event stop (PTRACE_O_TRACEFORK and friends, set only around an injected clone):
 * remember the child it announces. Returns 1 if the status was one. */
int bx_fork_event(struct bx_ctl *c, pid_t tid, int status)
{
	int event = status >> 16;
	if (event != PTRACE_EVENT_FORK && event != PTRACE_EVENT_CLONE && event != PTRACE_EVENT_VFORK)
		return 0;
	unsigned long msg = 0;
	ptrace(PTRACE_GETEVENTMSG, tid, 0, &msg);
	c->last_child = (pid_t)msg;
	return 1;
}

/* The SIGTRAP of a single step over the injected syscall instruction: the kernel reports it
 * as the call returns (TRAP_BRKPT, a code no other process can send), with the instruction
 * pointer just past the instruction. A SIGTRAP pending from before would stop us before the
 * instruction ran. */
static int step_trap(struct bx_ctl *c, pid_t tid, bx_regs_t *r, int *err)
{
	siginfo_t si;
	if (ptrace(PTRACE_GETSIGINFO, tid, 0, &si) || si.si_code != TRAP_BRKPT)
		return 0;
	if ((*err = bx_arch_get_regs(tid, r)))
		return 0;
	return bx_arch_ip(r) == c->sysaddr + BX_ARCH_SYSCALL_LEN;
}

/* An injected call did not return within the bound: interrupted (back in user space it is
 * restarted, or returns -EINTR, as cure leaves it), the thread stops for cure to put it back.
 * -ETIMEDOUT either way; not stopped even then (asleep uninterruptibly), it is left as is. */
static int overdue(struct bx_ctl *c, pid_t tid, int resume)
{
	int err = bx_stop_overdue(c, tid, resume);
	if (!err)
		err = bx_arch_get_regs(tid, &c->cur);
	bx_log("%d: injected call overdue, %s", tid, err ? "not stopped" : "stopped");
	c->overdue = tid;
	return -ETIMEDOUT;
}

/* Run the injected call by single-stepping over its instruction: the kernel reports the step
 * as the call returns, before any user instruction, so a call costs one stop instead of the
 * two (entry and exit) of PTRACE_SYSCALL. Signals are held back; an injected call they
 * interrupt is restarted by the kernel once the held signal is gone (its step shows a
 * -ERESTART* value, and stepping goes on). */
static int run_to_exit(struct bx_ctl *c, long *ret)
{
	pid_t tid = c->thr[0].tid;
	int st, err = 0;
	if (ptrace(PTRACE_SINGLESTEP, tid, 0, 0))
		return -errno;
	for (;;) {
		if ((err = bx_wait(c, tid, &st)) == -ETIMEDOUT) /* a call that blocks */
			return overdue(c, tid, PTRACE_SINGLESTEP);
		if (err)
			return err;
		int event = st >> 16, sig = WSTOPSIG(st);
		if (bx_fork_event(c, tid, st)) {
			/* noted in c->last_child: bx_clone3_seized adopts it */
		} else if (!event && sig == SIGTRAP && step_trap(c, tid, &c->cur, &err)) {
			long rv = bx_arch_retval(&c->cur);
			if (!bx_arch_is_restart(rv)) {
				*ret = rv;
				return 0;
			}
		} else if (err) {
			return err;
		} else if (!event) {
			if ((err = bx_hold_signal(c, tid, sig)))
				return err;
		}
		if (ptrace(PTRACE_SINGLESTEP, tid, 0, 0))
			return -errno;
	}
}

int bx_syscall_seized(struct bx_ctl *c, long nr, const unsigned long args[6], long *ret)
{
	int err;
	if ((err = bx_prepare_seized(c)))
		return err;
	bx_regs_t r = c->thr[0].regs;
	bx_arch_setup_syscall(&r, c->sysaddr, nr, args);
	if ((err = bx_arch_set_regs(c->thr[0].tid, &r)))
		return bx_fail(c, BX_STEP_SETREGS, err);
	c->injected = 1;
	c->cured = 0;
	if ((err = run_to_exit(c, ret)))
		return bx_fail(c, BX_STEP_SYSCALL, err);
	bx_log("%d: syscall %ld = %ld", c->pid, nr, *ret);
	return 0;
}

int bx_remote_mmap_seized(struct bx_ctl *c, unsigned long addr, size_t len, int prot, int flags,
			  int fd, off_t off, unsigned long *out)
{
	unsigned long a[6] = {addr, len, (unsigned long)prot, (unsigned long)flags,
			      (unsigned long)(long)fd, (unsigned long)off};
	long rv;
	int err = bx_syscall_seized(c, SYS_mmap, a, &rv);
	if (err)
		return err;
	if (rv < 0 && rv > -4096)
		return bx_fail(c, BX_STEP_SYSCALL, (int)rv);
	*out = (unsigned long)rv;
	return 0;
}

int bx_remote_munmap_seized(struct bx_ctl *c, unsigned long addr, size_t len)
{
	unsigned long a[6] = {addr, len};
	long rv;
	int err = bx_syscall_seized(c, SYS_munmap, a, &rv);
	if (err)
		return err;
	return rv ? bx_fail(c, BX_STEP_SYSCALL, (int)rv) : 0;
}
