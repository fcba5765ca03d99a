/* fidelity: capabilities a process dropped (effective, permitted, inheritable, bounding set) */
#include "../victim.h"
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

static unsigned long long status(const char *key)
{
	const char *s = strstr(slurp("/proc/self/status"), key);
	return s ? strtoull(s + strlen(key) + 1, 0, 16) : ~0ULL;
}

int main(void)
{
	fid_init();
	MUST(prctl(PR_CAPBSET_DROP, CAP_NET_RAW));
	struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
	struct __user_cap_data_struct d[2];
	MUST(syscall(SYS_capget, &h, d));
	d[0].effective &= ~(1U << CAP_NET_RAW | 1U << CAP_MKNOD);
	d[0].permitted &= ~(1U << CAP_NET_RAW);
	d[0].inheritable = 1U << CAP_CHOWN;
	MUST(syscall(SYS_capset, &h, d));
	unsigned long long eff = status("CapEff:"), prm = status("CapPrm:"), inh = status("CapInh:"), bnd = status("CapBnd:");
	ready();
	wait_term();
	CHECK(status("CapEff:") == eff, "CapEff %llx, want %llx", status("CapEff:"), eff);
	CHECK(status("CapPrm:") == prm, "CapPrm %llx, want %llx", status("CapPrm:"), prm);
	CHECK(status("CapInh:") == inh, "CapInh %llx, want %llx", status("CapInh:"), inh);
	CHECK(status("CapBnd:") == bnd, "CapBnd %llx, want %llx", status("CapBnd:"), bnd);
	return report();
}
